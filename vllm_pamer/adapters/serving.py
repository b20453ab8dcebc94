"""API-server side of vLLM, for the installed series (see ``__init__``)."""

from vllm_pamer.adapters import ADAPTERS, vllm_series

SERIES = vllm_series()  # refuses an unsupported vLLM here, at import
assert ADAPTERS[SERIES] == "vllm_0_32"  # a series with a package of its own becomes a branch here
from vllm_pamer.adapters.vllm_0_32.serving import (  # noqa: E402
    REQUEST_ERRORS,
    ChatCompletionRequest,
    ErrorResponse,
    api_keys,
    call_workers,
    internal_sampling_params,
    is_error,
    key_check,
    kv_cache_usage,
    kv_capacity_tokens,
    template_tools,
    validate_chat_request,
    with_cancellation,
    worker_extension,
)

__all__ = [
    "REQUEST_ERRORS",
    "ChatCompletionRequest",
    "ErrorResponse",
    "api_keys",
    "call_workers",
    "internal_sampling_params",
    "is_error",
    "key_check",
    "kv_cache_usage",
    "kv_capacity_tokens",
    "template_tools",
    "validate_chat_request",
    "with_cancellation",
    "worker_extension",
]
