"""The replayed request and its answer in the API the replay speaks
(``ReplaySettings.api``): chat completions, or the Responses API with the
whole history as input items each step (``store`` false: the server holds
nothing), so one trajectory can be replayed through either and compared."""

from __future__ import annotations

import json
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


class StreamedChat:
    """A streamed chat completion folded back into the answer's body (the
    message, its tool calls joined by index, the usage, the plugin's report on
    the last chunk), and when its first token came (text, a call or
    reasoning: a tool parser that holds a call's deltas back delays it)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.rest: dict[str, Any] = {}
        self.first_token = False
        self.done = False
        """``[DONE]`` came: the answer is whole."""

    def add(self, line: str) -> bool:
        """One line of the event stream; True when it carried the first token.
        ValueError: a line that is not JSON, or an error the stream ended with."""
        if line.strip() == "data: [DONE]":
            self.done = True
        if not line.startswith("data: {"):
            return False  # blank separators, [DONE]
        chunk = json.loads(line[6:])
        if chunk.get("error"):  # the server failed the request after its first byte
            raise ValueError(f"the stream ended in an error: {chunk['error']}")
        for key in ("usage", "pamer", "prompt_token_ids"):
            if chunk.get(key) is not None:
                self.rest[key] = chunk[key]
        delta = ((chunk.get("choices") or [{}])[0] or {}).get("delta") or {}
        if delta.get("content"):
            self.content.append(delta["content"])
        for call in delta.get("tool_calls") or []:
            held = self.calls.setdefault(int(call.get("index", 0)), {"function": {"name": "", "arguments": ""}})
            held.update({k: v for k, v in call.items() if k in ("id", "type") and v})
            function = call.get("function") or {}
            held["function"]["name"] += function.get("name") or ""
            held["function"]["arguments"] += function.get("arguments") or ""
        token = bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning"))
        first, self.first_token = token and not self.first_token, self.first_token or token
        return first

    def body(self) -> dict[str, Any]:
        """The body a request without ``stream`` would have had (what
        ``answer_message`` and ``usage_of`` read). ValueError: the stream
        stopped before ``[DONE]`` (a cut answer is no answer)."""
        if not self.done:
            raise ValueError("the stream stopped before [DONE]")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return {"choices": [{"message": message}], **self.rest}


def streamed(body: dict[str, Any]) -> dict[str, Any]:
    """A chat body asking for a stream with its usage on the last chunk."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}
