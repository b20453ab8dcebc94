"""The API-server side: the OpenAI protocol classes, request validation,
internal requests' sampling parameters, and the cancellation wrapper the
plugin's chat route shares with vLLM's own routes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError
from vllm import SamplingParams, envs
from vllm.entrypoints.anthropic.protocol import (
    AnthropicError,
    AnthropicErrorResponse,
    AnthropicMessagesRequest,
    AnthropicMessagesResponse,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionToolsParam
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse
from vllm.entrypoints.openai.responses.utils import construct_chat_messages_with_tool_call, construct_input_messages
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
from vllm.entrypoints.serve.utils.api_utils import with_cancellation
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import StructuredOutputsParams

REQUEST_ERRORS: tuple[type[Exception], ...] = (ValidationError, VLLMClientError)
"""What ``validate_chat_request`` raises for a request vLLM would refuse."""


def validate_chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The body as vLLM's own chat route validates it."""
    return ChatCompletionRequest.model_validate(body)


def template_tools(
    tools: list[ChatCompletionToolsParam] | None, tool_choice: Any, exclude_when_choice_none: bool
) -> list[dict] | None:
    """A request's tools as vLLM's renderer passes them to the chat template
    (``OnlineRenderer``: none when ``tool_choice`` is "none" and the server runs
    with ``--exclude-tools-when-tool-choice-none``)."""
    if not tools or (tool_choice == "none" and exclude_when_choice_none):
        return None
    return [tool.model_dump() for tool in tools]


def internal_sampling_params(
    max_tokens: int, extra_args: dict[str, Any], json_schema: dict | None = None
) -> SamplingParams:
    """Greedy parameters of the plugin's own engine requests; ``json_schema``
    constrains the answer, with no free whitespace (so a constrained answer
    cannot pad itself to ``max_tokens``)."""
    structured = (
        StructuredOutputsParams(json=json_schema, disable_any_whitespace=True) if json_schema is not None else None
    )
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured, extra_args=extra_args)


KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"
"""vLLM's gauge of the KV cache in use (0-1), set per engine step by its
Prometheus stat logger in the API-server process (``v1/metrics/loggers.py``)."""


def kv_cache_usage() -> float | None:
    """The highest KV-cache usage any engine last reported; None before the
    first report or without vLLM's Prometheus logger."""
    from prometheus_client import REGISTRY

    collector = getattr(REGISTRY, "_names_to_collectors", {}).get(KV_USAGE_METRIC)
    if collector is None:
        return None
    values = [sample.value for metric in collector.collect() for sample in metric.samples]
    return max(values) if values else None


def kv_capacity_tokens(engine_client: Any) -> int | None:
    """Tokens the KV cache holds, all engines together: the engine client
    copies the engines' block counts into its own config at start-up
    (``v1/engine/core_client.py``, summed over data-parallel engines)."""
    cache = getattr(getattr(engine_client, "vllm_config", None), "cache_config", None)
    blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    return blocks * size if blocks and size else None


def worker_extension(engine_client: Any) -> str:
    """The engine's ``--worker-extension-cls`` ("" when none)."""
    parallel = getattr(getattr(engine_client, "vllm_config", None), "parallel_config", None)
    return str(getattr(parallel, "worker_extension_cls", "") or "")


async def call_workers(engine_client: Any, method: str, *args: Any, timeout: float | None) -> list[Any]:
    """``method`` of the worker extension on every worker of every engine
    (``EngineClient.collective_rpc``; data-parallel engines all get it)."""
    return list(await engine_client.collective_rpc(method, timeout=timeout, args=args))


def api_keys(args: Any) -> list[str]:
    """The API keys vLLM's own routes accept: ``--api-key`` (any number of
    them), else ``VLLM_API_KEY``, as ``entrypoints/serve/middleware/register.py``
    reads them; empty when the server runs without a key."""
    return [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]


def key_check(keys: list[str]) -> Callable[[Mapping[str, str]], bool]:
    """Whether a request's headers carry one of ``keys``, by vLLM's own check
    (``AuthenticationMiddleware.verify_token``: a Bearer token, compared by
    digest in constant time)."""
    check = AuthenticationMiddleware(None, keys)  # only its check is used: no app behind it
    return check.verify_token


def is_error(result: Any) -> bool:
    """Whether a chat handler's result is vLLM's error response."""
    return isinstance(result, ErrorResponse)


def anthropic_chat_request(body: dict[str, Any], handler: Any) -> ChatCompletionRequest:
    """An Anthropic Messages body as the chat request vLLM's ``/v1/messages``
    makes of it (``AnthropicServingMessages.create_messages``: system first,
    ``tool_use`` as tool calls, ``tool_result`` as tool messages): the view
    the plugin's pipeline reads. Raises one of ``REQUEST_ERRORS`` for a body
    vLLM would refuse."""
    request = AnthropicMessagesRequest.model_validate(body)
    return handler.to_chat_completion_request(request, merge_inline_system=handler._merge_inline_system)


def anthropic_request(body: dict[str, Any]) -> AnthropicMessagesRequest:
    """A Messages body as vLLM's ``/v1/messages`` validates it (raises one of ``REQUEST_ERRORS``)."""
    return AnthropicMessagesRequest.model_validate(body)


def anthropic_error(message: str, err_type: str) -> dict[str, Any]:
    """An error body as vLLM's ``/v1/messages`` writes one."""
    return AnthropicErrorResponse(error=AnthropicError(type=err_type, message=message)).model_dump()


def anthropic_content(answer: AnthropicMessagesResponse) -> dict[str, Any]:
    """A whole Messages answer as vLLM's route sends it."""
    return answer.model_dump(exclude_none=True)


def responses_request(body: dict[str, Any]) -> ResponsesRequest:
    """A Responses body as vLLM's ``/v1/responses`` validates it (raises one of ``REQUEST_ERRORS``)."""
    return ResponsesRequest.model_validate(body)


def responses_chat_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """A Responses request's ``instructions`` and ``input`` as the chat
    messages vLLM's ``/v1/responses`` renders (``construct_input_messages``:
    instructions first, a function call merged into the assistant message
    before it, an output as a tool message), as plain JSON. Raises one of
    ``REQUEST_ERRORS`` for an input vLLM would refuse."""
    messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
    return [_plain(m) for m in messages]


def responses_output_messages(answer: ResponsesResponse) -> list[dict[str, Any]]:
    """A response's output items as the chat messages vLLM reads them as when
    they come back as input (its text, reasoning and function calls)."""
    return [_plain(m) for m in construct_chat_messages_with_tool_call(list(answer.output))]


def responses_content(answer: ResponsesResponse) -> dict[str, Any]:
    """A whole Responses answer as vLLM's route sends it."""
    return answer.model_dump(mode="json", by_alias=True)


def responses_event(event: Any) -> tuple[str, dict[str, Any]]:
    """A streamed Responses event's type and data as vLLM's route writes them."""
    return str(getattr(event, "type", "unknown")), event.model_dump(mode="json", by_alias=True)


def _plain(message: Any) -> dict[str, Any]:
    """A message built of TypedDicts and pydantic items as JSON-able dicts."""
    from pydantic_core import to_jsonable_python

    return dict(to_jsonable_python(message, by_alias=True))


__all__ = [
    "REQUEST_ERRORS",
    "ChatCompletionRequest",
    "ErrorResponse",
    "anthropic_chat_request",
    "anthropic_content",
    "anthropic_error",
    "anthropic_request",
    "api_keys",
    "internal_sampling_params",
    "is_error",
    "key_check",
    "kv_cache_usage",
    "responses_chat_messages",
    "responses_content",
    "responses_event",
    "responses_output_messages",
    "responses_request",
    "template_tools",
    "validate_chat_request",
    "with_cancellation",
]
