"""vLLM plugin entry points.

* ``register`` - ``vllm.general_plugins``; runs in every vLLM process (API
  server, EngineCore, workers), so it only does re-entrant things: select the
  V1 model runner where vLLM would pick V2 (our capture hooks the V1 runner),
  fix the capture channel address for the child processes to inherit, and
  register the capturing model classes over vLLM's own.
* ``endpoint`` - ``vllm.endpoint_plugins``; the API-server routes.
"""

from __future__ import annotations

import os

# architecture -> our capturing class in vllm_pamer.engine.models
CAPTURING_MODELS = {
    "LlamaForCausalLM": "PamerLlamaForCausalLM",
    "Qwen2ForCausalLM": "PamerQwen2ForCausalLM",
    "Qwen3ForCausalLM": "PamerQwen3ForCausalLM",
}

PLUGIN_NAMES = "pamer,pamer_endpoint"
"""The value of VLLM_PLUGINS that enables both halves."""


def register() -> None:
    from vllm import ModelRegistry

    from vllm_pamer.channel import ensure_channel_address

    # Model Runner V2 (GPU default when Triton is present) is not hooked yet.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    ensure_channel_address()
    for arch, cls in CAPTURING_MODELS.items():
        ModelRegistry.register_model(arch, f"vllm_pamer.engine.models:{cls}")


def endpoint():
    from vllm_pamer.server.endpoint import PamerEndpointPlugin

    return PamerEndpointPlugin()
