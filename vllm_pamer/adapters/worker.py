"""Engine side of vLLM, for the installed series (see ``__init__``)."""

from vllm_pamer.adapters import vllm_series

SERIES = vllm_series()  # refuses an unsupported vLLM here, at import

# One series so far; a second one becomes a branch on SERIES.
from vllm_pamer.adapters.vllm_0_32.registration import register  # noqa: E402

__all__ = ["register"]
