"""The Responses API (``POST /v1/responses``) as a managed API (``apis.py``).

In: ``instructions`` and ``input`` become chat messages as vLLM's own route
makes them (``construct_input_messages``: a function call joins the assistant
message before it, an output is a tool message). Out: the rewritten view as
input items again (``response_items``, which vLLM reads back as the same
view), answered by vLLM's ``create_responses``, the ``pamer`` report on the
response (the body, or the streamed ``response.completed`` event's response).

Server-held conversations: a request with ``previous_response_id`` sends only
its new items. vLLM keeps history only with ``VLLM_ENABLE_RESPONSES_API_STORE``
and, once the memory rewrites a request, it would keep the rewritten view, not
the agent's history. So the plugin holds each answered response's whole
history itself (``HeldConversations``: per session, per API process, the least
recently used forgotten first), continues it with the new items, and sends the
result as a stateless request. A ``previous_response_id`` this process does
not hold for the session goes to vLLM as sent (``fallback:unknown_conversation``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_pamer.adapters.serving import (
    REQUEST_ERRORS,
    ChatCompletionRequest,
    responses_chat_messages,
    responses_content,
    responses_event,
    responses_output_messages,
    responses_request,
)
from vllm_pamer.core.blocks import Message
from vllm_pamer.server.access import BadSessionId
from vllm_pamer.server.apis import ManagedApi, PassThrough, UnreadableBody, chat_messages
from vllm_pamer.server.input import SESSION_HEADER, session_id_of
from vllm_pamer.server.output import ReportMaker
from vllm_pamer.server.sessions import HeldConversations

TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text"}


def _chat_content(content: Any) -> Any:
    """A Responses message's content as chat content (``input_text`` -> ``text``, ``input_image`` -> ``image_url``)."""
    if not isinstance(content, list):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image" and part.get("image_url"):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append(part)  # vLLM's validation says what it makes of it
    return parts


def _item_content(content: Any, role: str) -> Any:
    """Chat content as a Responses message's content (the way back of ``_chat_content``)."""
    if not isinstance(content, list):
        return content if content is not None else ""
    text_type = "output_text" if role == "assistant" else "input_text"
    parts: list[dict[str, Any]] = []
    for part in content:
        if part.get("type") == "text":
            parts.append({"type": text_type, "text": part.get("text", "")})
        elif part.get("type") == "image_url":
            url = (part.get("image_url") or {}).get("url", "")
            parts.append({"type": "input_image", "image_url": url, "detail": "auto"})
        else:
            parts.append(part)
    return parts


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def response_items(messages: Sequence[Message]) -> tuple[str | None, list[dict[str, Any]]]:
    """Chat messages as the ``instructions`` and ``input`` of a Responses body
    that vLLM reads back as the same messages: a first system message with
    text as ``instructions``; an assistant's reasoning, text and tool calls as
    a ``reasoning`` item, a message and ``function_call`` items (vLLM joins
    them into one message again, and joins them to an assistant message right
    before them that has no calls: nothing is lost or reordered); a tool
    message as a ``function_call_output``; every other message a message."""
    instructions = None
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        instructions, messages = messages[0]["content"], messages[1:]
    items: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = str(message.get("role"))
        if role == "tool":
            output = message.get("content")
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message.get("tool_call_id"),
                    "output": output if isinstance(output, str) else _text(output),
                }
            )
            continue
        if role != "assistant":
            items.append({"role": role, "content": _item_content(message.get("content"), role)})
            continue
        if message.get("reasoning"):
            text = {"type": "reasoning_text", "text": message["reasoning"]}
            items.append({"type": "reasoning", "id": f"rs_{index}", "summary": [], "content": [text]})
        content = message.get("content")
        if content or not message.get("tool_calls"):
            items.append({"role": "assistant", "content": _text(content)})
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            items.append(
                {
                    "type": "function_call",
                    "call_id": call.get("id"),
                    "name": function.get("name"),
                    "arguments": function.get("arguments") or "",
                }
            )
    return instructions, items


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's function tools as chat tools (what the prompt count and
    the chat checks read; built-in tools are vLLM's to handle)."""
    out = []
    for tool in tools or []:
        if isinstance(tool, dict) and tool.get("type") == "function" and tool.get("name"):
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    return None


PASSED_TO_CHAT = ("model", "session_id", "vllm_xargs", "pamer_policy", "pamer_echo", "pamer_context_budget")
"""Fields of a Responses body the chat view keeps as they are."""


class ResponsesApi(ManagedApi):
    """One ``POST /v1/responses`` request (an instance per request: it keeps
    the history it continues, to hold it with the answer)."""

    name = "responses"
    handler = "openai_serving_responses"

    def __init__(self) -> None:
        self.history: list[Message] = []
        """The whole history the request sends (held ones and its own items)."""
        self.session: str | None = None
        """The session's key (``server/access.py``), if the request names one."""
        self._held: HeldConversations | None = None
        """Where the answer is held (set when the session keeps its responses)."""

    async def chat_body(self, body: dict[str, Any], handler: Any, raw_request: Request) -> dict[str, Any]:
        try:
            request = responses_request({k: v for k, v in body.items() if not k.startswith("pamer_")})
            messages = responses_chat_messages(request)
        except REQUEST_ERRORS as exc:
            raise UnreadableBody(f"invalid responses request: {exc}") from None
        state = raw_request.app.state.pamer
        try:
            name = session_id_of(raw_request.headers.get(SESSION_HEADER), body.get("session_id"))
            self.session = state.access.session_key(raw_request.headers, name) if name else None
        except BadSessionId:
            self.session = None  # read_chat refuses it with its own message
        if request.previous_response_id:
            held = state.held_responses.get(self.session, request.previous_response_id) if self.session else None
            if held is None:
                raise PassThrough("unknown_conversation")
            lead = [m for m in messages if m.get("role") == "system"][:1] if request.instructions else []
            # instructions do not carry over (vLLM's construct_input_messages drops earlier system messages)
            messages = lead + [m for m in held if m.get("role") != "system"] + messages[len(lead) :]
        self.history = messages
        chat: dict[str, Any] = {k: body[k] for k in PASSED_TO_CHAT if k in body}
        chat["messages"] = [{**m, "content": _chat_content(m.get("content"))} for m in messages]
        if tools := _chat_tools(body.get("tools")):
            chat["tools"] = tools
            if (choice := _chat_tool_choice(body.get("tool_choice"))) is not None:
                chat["tool_choice"] = choice
        if request.max_output_tokens:
            chat["max_completion_tokens"] = request.max_output_tokens
        return chat

    def _body(self, body: dict[str, Any], messages: Sequence[Message], xargs: Any) -> dict[str, Any]:
        instructions, items = response_items(messages)
        sent = {k: v for k, v in body.items() if not k.startswith("pamer_") and k != "previous_response_id"}
        sent.update(input=items, instructions=instructions, vllm_xargs=xargs)
        return sent

    async def send(
        self, handler: Any, body: dict[str, Any], request: ChatCompletionRequest, raw_request: Request
    ) -> Any:
        sent = responses_request(self._body(body, chat_messages(request), request.vllm_xargs))
        answer = await handler.create_responses(sent, raw_request)
        if self.session is not None and sent.store is not False:
            self._held = raw_request.app.state.pamer.held_responses
            if hasattr(answer, "output"):
                self._hold(answer)
        return answer

    def _hold(self, answer: Any) -> None:
        """Holds the history ``answer`` ends (a completed response only)."""
        if self._held is not None and self.session is not None and getattr(answer, "status", None) == "completed":
            self._held.hold(self.session, answer.id, [*self.history, *responses_output_messages(answer)])

    async def pass_through(self, handler: Any, body: dict[str, Any], raw_request: Request) -> Any:
        sent = {k: v for k, v in body.items() if not k.startswith("pamer_")}
        return await handler.create_responses(responses_request(sent), raw_request)

    async def respond(self, answer: Any, report: ReportMaker | None, headers: dict[str, str]) -> Response:
        if not hasattr(answer, "__aiter__"):
            content = responses_content(answer)
            if report is not None:
                content["pamer"] = await report()
            return JSONResponse(content=content, headers=headers)
        return StreamingResponse(self._events(answer, report), media_type="text/event-stream", headers=headers)

    async def _events(self, answer: AsyncIterator[Any], report: ReportMaker | None) -> AsyncIterator[str]:
        """vLLM's events as its route writes them; the completed response
        carries the report and is held (a streamed answer is held once it completes)."""
        async for event in answer:
            kind, data = responses_event(event)
            if kind == "response.completed":
                self._hold(getattr(event, "response", None))
                if report is not None and isinstance(data.get("response"), dict):
                    data["response"]["pamer"] = await report()
            yield f"event: {kind}\ndata: {json.dumps(data)}\n\n"
