"""Engine side of vLLM, for the installed series (see ``__init__``)."""

from vllm_pamer.adapters import ADAPTERS, vllm_series

SERIES = vllm_series()  # refuses an unsupported vLLM here, at import
assert ADAPTERS[SERIES] == "vllm_0_32"  # a series with a package of its own becomes a branch here
from vllm_pamer.adapters.vllm_0_32.registration import register  # noqa: E402

__all__ = ["register"]
