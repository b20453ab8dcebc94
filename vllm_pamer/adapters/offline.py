"""vLLM's offline ``LLM``, for the installed series (see ``__init__``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_pamer.adapters import implementation

if TYPE_CHECKING:  # callers are type-checked against the reference package
    from vllm_pamer.adapters.vllm_from_0_32.offline import (
        generate_captures,
        kv_block_size,
        make_llm,
        max_model_len,
        metric_total,
        model_dtype,
        shutdown,
        tokenizer,
    )

__all__ = [
    "generate_captures",
    "kv_block_size",
    "make_llm",
    "max_model_len",
    "metric_total",
    "model_dtype",
    "shutdown",
    "tokenizer",
]

if not TYPE_CHECKING:
    globals().update(implementation("offline", __all__))
