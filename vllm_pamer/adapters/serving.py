"""API-server side of vLLM, for the installed series (see ``__init__``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_pamer.adapters import implementation

if TYPE_CHECKING:  # callers are type-checked against the reference package
    from vllm_pamer.adapters.vllm_from_0_32.serving import (
        REQUEST_ERRORS,
        ChatCompletionRequest,
        ErrorResponse,
        anthropic_chat_request,
        anthropic_content,
        anthropic_error,
        anthropic_request,
        api_keys,
        call_workers,
        internal_sampling_params,
        is_error,
        key_check,
        kv_cache_usage,
        kv_capacity_tokens,
        responses_chat_messages,
        responses_content,
        responses_event,
        responses_output_messages,
        responses_request,
        template_tools,
        validate_chat_request,
        with_cancellation,
        worker_extension,
    )

__all__ = [
    "REQUEST_ERRORS",
    "ChatCompletionRequest",
    "ErrorResponse",
    "anthropic_chat_request",
    "anthropic_content",
    "anthropic_error",
    "anthropic_request",
    "api_keys",
    "call_workers",
    "internal_sampling_params",
    "is_error",
    "key_check",
    "kv_cache_usage",
    "kv_capacity_tokens",
    "responses_chat_messages",
    "responses_content",
    "responses_event",
    "responses_output_messages",
    "responses_request",
    "template_tools",
    "validate_chat_request",
    "with_cancellation",
    "worker_extension",
]

if not TYPE_CHECKING:
    globals().update(implementation("serving", __all__))
