"""The APIs whose requests the plugin manages, each an adapter between its
own request and answer and the chat view the rest of the route reads
(``routes.py``): the client's body becomes a chat request (``chat_body``),
the rewritten chat view goes back to that API's shape and to vLLM's own
handler of that API (``send``, so its validation, streaming events and
errors stay vLLM's), with the ``pamer`` report where that API's clients
find it (``respond``) and errors written as that API writes them (``error``).

* ``chat``: ``POST /v1/chat/completions``, as received.
* ``responses``: ``POST /v1/responses``, ``server/responses.py`` (with the
  conversations ``previous_response_id`` continues, held by the plugin).
* ``messages``: ``POST /v1/messages`` (Anthropic). In: converted as vLLM's
  route converts it (``tool_use`` -> tool calls, ``tool_result`` -> tool
  messages). Out: the rewritten view as Anthropic turns again
  (``anthropic_turns``, which vLLM reads back as the same view: a tool call
  is never parted from its result, since the rewrite keeps or drops whole
  blocks), answered by vLLM's
  ``create_messages``. A policy's own tools (SAM's ``memory``) are offered
  on chat completions only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vllm_pamer.adapters.serving import (
    REQUEST_ERRORS,
    ChatCompletionRequest,
    anthropic_chat_request,
    anthropic_content,
    anthropic_error,
    anthropic_request,
)
from vllm_pamer.core.blocks import Message
from vllm_pamer.server.output import ReportMaker, error_response, with_messages_report, with_report


class UnreadableBody(Exception):
    """A body the API's own route would refuse (400)."""


class PassThrough(Exception):
    """A request the plugin cannot manage: vLLM answers the body as sent
    (``ManagedApi.pass_through``); the argument names the ``core/fallback.py`` rule."""


class ManagedApi:
    """One API the plugin manages: what differs from chat completions."""

    name: ClassVar[str]
    handler: ClassVar[str]
    """The ``app.state`` attribute of vLLM's handler of this API."""
    own_tools: ClassVar[bool] = False
    """A policy's own tools may be offered (their calls are answered on chat answers)."""

    async def chat_body(self, body: dict[str, Any], handler: Any, raw_request: Request) -> dict[str, Any]:
        """The client's body as a chat completions body; raises
        ``UnreadableBody``, or ``PassThrough`` for a body to send as it is."""
        return body

    async def pass_through(self, handler: Any, body: dict[str, Any], raw_request: Request) -> Any:
        """vLLM's answer to the client's body as sent (after ``PassThrough``)."""
        raise NotImplementedError(f"the {self.name} API passes nothing through")

    async def send(
        self, handler: Any, body: dict[str, Any], request: ChatCompletionRequest, raw_request: Request
    ) -> Any:
        """vLLM's answer to the rewritten ``request`` (the client's ``body``
        beside it), in this API's shape, or vLLM's error response."""
        return await handler.create_chat_completion(request, raw_request)

    def error(self, status: int, message: str, err_type: str | None = None) -> JSONResponse:
        return error_response(status, message, err_type)

    def error_from(self, result: Any) -> JSONResponse:
        """vLLM's error response in this API's shape."""
        return JSONResponse(content=result.model_dump(), status_code=result.error.code)

    async def respond(self, answer: Any, report: ReportMaker | None, headers: dict[str, str]) -> Response:
        """The answer with the report (None: a passed-through request has none)."""
        return await with_report(answer, report, headers)


class ChatApi(ManagedApi):
    name = "chat"
    handler = "openai_serving_chat"
    own_tools = True


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's error ``type`` by status (else ``api_error``)."""


class MessagesApi(ManagedApi):
    name = "messages"
    handler = "anthropic_serving_messages"

    async def chat_body(self, body: dict[str, Any], handler: Any, raw_request: Request) -> dict[str, Any]:
        try:
            request = anthropic_chat_request(body, handler)
        except REQUEST_ERRORS as exc:
            raise UnreadableBody(f"invalid messages request: {exc}") from None
        return request.model_dump(exclude_unset=True)

    async def send(
        self, handler: Any, body: dict[str, Any], request: ChatCompletionRequest, raw_request: Request
    ) -> Any:
        system, turns = anthropic_turns(chat_messages(request))
        sent = {k: v for k, v in body.items() if k not in ("system", "messages")}
        sent.update(messages=turns, vllm_xargs=request.vllm_xargs)
        if system:
            sent["system"] = system
        return await handler.create_messages(anthropic_request(sent), raw_request)

    def error(self, status: int, message: str, err_type: str | None = None) -> JSONResponse:
        kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
        return JSONResponse(content=anthropic_error(message, kind), status_code=status)

    def error_from(self, result: Any) -> JSONResponse:
        return JSONResponse(
            content=anthropic_error(result.error.message, result.error.type), status_code=result.error.code
        )

    async def respond(self, answer: Any, report: ReportMaker | None, headers: dict[str, str]) -> Response:
        if hasattr(answer, "__aiter__"):
            return await with_messages_report(answer, report, headers)
        content = anthropic_content(answer)
        if report is not None:
            content["pamer"] = await report()
        return JSONResponse(content=content, headers=headers)


CHAT, MESSAGES = ChatApi(), MessagesApi()


def chat_messages(request: ChatCompletionRequest) -> list[Message]:
    """The messages of a validated chat request as plain dicts."""
    return [dict(m) if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in request.messages]


def _blocks(content: Any) -> list[dict[str, Any]]:
    """A chat message's content as Anthropic content blocks (text, images)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    blocks: list[dict[str, Any]] = []
    for part in content or []:
        if part.get("type") == "text" and part.get("text"):
            blocks.append({"type": "text", "text": part["text"]})
        elif part.get("type") == "image_url":
            url = str((part.get("image_url") or {}).get("url", ""))
            if url.startswith("data:") and ";base64," in url:
                media, data = url[5:].split(";base64,", 1)
                blocks.append({"type": "image", "source": {"type": "base64", "media_type": media, "data": data}})
            else:
                blocks.append({"type": "image", "source": {"type": "url", "url": url}})
    return blocks


def _input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as a ``tool_use`` input (an object)."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def anthropic_turns(messages: Sequence[Message]) -> tuple[str | None, list[dict[str, Any]]]:
    """Chat messages as the ``system`` and ``messages`` of an Anthropic body
    that vLLM reads back as the same messages: leading system messages as
    ``system``; an assistant's reasoning, text and tool calls as ``thinking``,
    ``text`` and ``tool_use`` blocks; consecutive tool messages as the
    ``tool_result`` blocks of one user turn; every other message a turn of
    its own (vLLM takes consecutive user turns as they come)."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    system = "".join(str(m.get("content") or "") for m in messages[:lead]) or None
    turns: list[dict[str, Any]] = []
    for message in messages[lead:]:
        role = message.get("role")
        blocks: list[dict[str, Any]] = []
        if role == "assistant":
            if message.get("reasoning"):
                blocks.append({"type": "thinking", "thinking": message["reasoning"]})
            blocks += _blocks(message.get("content"))
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call.get("id"),
                        "name": function.get("name"),
                        "input": _input(function.get("arguments")),
                    }
                )
        elif role == "tool":
            role = "user"
            blocks.append(
                {
                    "type": "tool_result",
                    "tool_use_id": message.get("tool_call_id"),
                    "content": _blocks(message.get("content")) or " ",
                }
            )
        else:
            blocks += _blocks(message.get("content"))
        if not blocks:
            continue
        if message.get("role") == "tool" and turns and turns[-1]["content"][-1]["type"] == "tool_result":
            turns[-1]["content"] += blocks  # a call's results answer it in one turn
        else:
            turns.append({"role": role, "content": blocks})
    return system, turns
