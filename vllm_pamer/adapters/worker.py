"""Engine side of vLLM, for the installed series (see ``__init__``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_pamer.adapters import implementation

if TYPE_CHECKING:  # callers are type-checked against the reference package
    from vllm_pamer.adapters.vllm_from_0_32.registration import register

__all__ = ["register"]

if not TYPE_CHECKING:
    globals().update(implementation("registration", __all__))
