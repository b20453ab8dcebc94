"""vLLM 0.32: what the general plugin does in every vLLM process (API server,
EngineCore, workers), so only re-entrant, light things: pick the V1 model
runner where vLLM would pick V2 (the capture hooks V1), and register the
capturing model classes by name (``models.py`` is imported by the worker
that builds the model, not here)."""

from __future__ import annotations

import os

CAPTURING_MODELS = {
    "LlamaForCausalLM": "PamerLlamaForCausalLM",
    "Qwen2ForCausalLM": "PamerQwen2ForCausalLM",
    "Qwen3ForCausalLM": "PamerQwen3ForCausalLM",
}
"""Architecture -> our capturing class in ``models.py``."""


def register() -> None:
    from vllm import ModelRegistry

    # Model Runner V2 (the GPU default when Triton is present) is not hooked yet.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    for arch, cls in CAPTURING_MODELS.items():
        ModelRegistry.register_model(arch, f"vllm_pamer.adapters.vllm_0_32.models:{cls}")
