"""The replayed request and its answer in the API the replay speaks
(``ReplaySettings.api``): chat completions, or the Responses API with the
whole history as input items each step (``store`` false: the server holds
nothing), so one trajectory can be replayed through either and compared."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from vllm_pamer.core.blocks import Message
from vllm_pamer.core.response_items import response_items

Api = Literal["chat", "responses"]
ROUTES: dict[str, str] = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


def request_body(
    api: str, model: str, history: Sequence[Message], tools: Sequence[dict[str, Any]] | None, max_tokens: int
) -> dict[str, Any]:
    """One replayed step's body (greedy)."""
    if api == "chat":
        body: dict[str, Any] = {"model": model, "messages": list(history), "max_tokens": max_tokens, "temperature": 0}
        if tools:
            body["tools"] = list(tools)
        return body
    instructions, items = response_items(history)
    body = {"model": model, "input": items, "max_output_tokens": max_tokens, "temperature": 0, "store": False}
    if instructions is not None:
        body["instructions"] = instructions
    if tools:  # a chat tool's function, flat
        body["tools"] = [{"type": "function", **tool["function"]} for tool in tools if tool.get("function")]
    return body


def answer_message(api: str, data: dict[str, Any]) -> dict[str, Any]:
    """The model's answer as a chat message (its text and tool calls)."""
    if api == "chat":
        return dict((data.get("choices") or [{}])[0].get("message") or {})
    text, calls = [], []
    for item in data.get("output") or []:
        if item.get("type") == "message":
            text += [part.get("text", "") for part in item.get("content") or [] if isinstance(part, dict)]
        elif item.get("type") == "function_call":
            calls.append(
                {"id": item.get("call_id"), "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            )
    return {"role": "assistant", "content": "".join(text), "tool_calls": calls}


def usage_of(api: str, data: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(prompt tokens, completion tokens, cached prompt tokens) the answer reports."""
    usage = data.get("usage") or {}
    if api == "chat":
        details = usage.get("prompt_tokens_details") or {}
        return usage.get("prompt_tokens"), usage.get("completion_tokens"), details.get("cached_tokens")
    details = usage.get("input_tokens_details") or {}
    return usage.get("input_tokens"), usage.get("output_tokens"), details.get("cached_tokens")
