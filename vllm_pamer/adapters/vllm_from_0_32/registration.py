"""What the general plugin does in every vLLM process (API server,
EngineCore, workers), so only re-entrant, light things: make vLLM's model
registry resolve every architecture to its capturing class (``models.py``,
imported when an architecture is resolved, by then vLLM has loaded torch). The
model runner stays the one vLLM picks; ``models.py`` installs its adapter."""

from __future__ import annotations

import functools
from typing import Any

_HOOK_FLAG = "_vllm_pamer_capturing"


def register() -> None:
    from vllm import ModelRegistry

    original = ModelRegistry.resolve_model_cls
    if getattr(original, _HOOK_FLAG, False):
        return

    @functools.wraps(original)
    def resolve_model_cls(architectures: Any, model_config: Any) -> tuple[type, str]:
        from vllm_pamer.adapters.vllm_from_0_32.models import capturing

        cls, arch = original(architectures, model_config=model_config)
        # the served model only: a speculative drafter ("draft") or a pooling model samples nothing of ours
        if getattr(model_config, "runner_type", "generate") != "generate":
            return cls, arch
        return capturing(cls), arch

    setattr(resolve_model_cls, _HOOK_FLAG, True)
    ModelRegistry.resolve_model_cls = resolve_model_cls
