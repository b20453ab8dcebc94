"""The Responses API (``POST /v1/responses``) as a managed API (``apis.py``).

In: ``instructions`` and ``input`` become chat messages as vLLM's own route
makes them (``construct_input_messages``: a function call joins the assistant
message before it, an output is a tool message). Out: the rewritten view as
input items again (``response_items``, which vLLM reads back as the same
view), answered by vLLM's ``create_responses``, the ``pamer`` report on the
response (the body, or the streamed ``response.completed`` event's response).

Server-held conversations: a request with ``previous_response_id`` sends only
its new items. vLLM keeps history only in memory, with
``VLLM_ENABLE_RESPONSES_API_STORE``, and once the memory rewrites a request it
would keep the rewritten view, not the agent's history. So the plugin holds
every finished answer (unless ``store`` is false) in its memory store
(``MemoryStore.hold_response``: what the request added and the output, keyed
by the response id within the caller's tenant, filed under the session), reads
the whole conversation back for a later turn, and sends vLLM a whole request.
The session is the request's (``X-Session-ID``, ``session_id``, else
``conversation``), else the conversation's (its first answer's id when no
request named one). A response id not held in the caller's tenant goes
to vLLM as sent (``fallback:unknown_conversation``: vLLM's own store, or 404);
``GET /v1/responses/{id}`` answers a held response (``routes.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
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
from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.response_items import response_items
from vllm_pamer.core.store import MemoryStore, StoreError
from vllm_pamer.server.access import BadSessionId
from vllm_pamer.server.apis import ManagedApi, PassThrough, UnreadableBody, chat_messages
from vllm_pamer.server.input import InputError, session_header, session_id_of
from vllm_pamer.server.output import ReportMaker

logger = logging.getLogger("vllm_pamer.server")

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


def named_session(header: str | None, body: dict[str, Any]) -> str | None:
    """The session a Responses request names: the header, else its
    ``session_id``, else its ``conversation`` (an id, or an object with
    one: OpenAI's conversation parameter, which vLLM 0.32 does not serve);
    None: the conversation's own (``previous_response_id``). Raises
    ``BadSessionId``."""
    named = session_id_of(header, body.get("session_id"))
    if named is not None:
        return named
    conversation = body.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    return session_id_of(None, conversation) if conversation is not None else None


HELD_STATUSES = ("completed", "incomplete")
"""Answers a later turn may continue (``incomplete``: cut at ``max_output_tokens``)."""

PASSED_TO_CHAT = ("model", "session_id", "vllm_xargs", "pamer_policy", "pamer_echo", "pamer_context_budget")
"""Fields of a Responses body the chat view keeps as they are."""


class ResponsesApi(ManagedApi):
    """One ``POST /v1/responses`` request (an instance per request: it keeps
    the conversation it continues, to hold the answer with it)."""

    name = "responses"
    handler = "openai_serving_responses"

    def __init__(self) -> None:
        self.added: list[Message] = []
        """What this request adds to its conversation (its instructions apart)."""
        self.parent: str | None = None
        """The key of the held answer it continues."""
        self.session_name: str | None = None
        """The session it names, else its conversation's."""
        self.held_by: tuple[MemoryStore, Callable[[str], str]] | None = None
        """Where its answer is held, and a response id's key in the caller's tenant (None: not held)."""

    async def chat_body(self, body: dict[str, Any], handler: Any, raw_request: Request) -> dict[str, Any]:
        try:
            request = responses_request({k: v for k, v in body.items() if not k.startswith("pamer_")})
            messages = responses_chat_messages(request)
        except REQUEST_ERRORS as exc:
            raise UnreadableBody(f"invalid responses request: {exc}") from None
        state = raw_request.app.state.pamer

        def key(response_id: str) -> str:
            return str(state.access.session_key(raw_request.headers, response_id))

        lead = messages[:1] if request.instructions else []
        self.added = messages[len(lead) :]
        header = session_header(raw_request.headers, state.settings)
        try:
            self.session_name = named_session(header, body)
        except BadSessionId as exc:
            if header is None and body.get("session_id") is None:
                raise UnreadableBody(f"invalid conversation: {exc}") from None
            self.session_name = None  # read_chat refuses it in its own words
        if request.previous_response_id:
            try:
                held = await state.store.held_response(key(request.previous_response_id))
            except StoreError as exc:
                raise InputError(f"the memory store could not be read: {exc}", 503) from None
            if held is None:
                raise PassThrough(Fallback.UNKNOWN_CONVERSATION.value)
            self.parent = key(request.previous_response_id)
            self.session_name = self.session_name or held.session_name
            # instructions do not carry over (as vLLM's construct_input_messages)
            messages = lead + [m for m in held.history if m.get("role") != "system"] + self.added
        if body.get("store") is not False:
            self.held_by = (state.store, key)
        chat: dict[str, Any] = {k: body[k] for k in PASSED_TO_CHAT if k in body}
        if self.session_name is not None:
            chat["session_id"] = self.session_name
        chat["messages"] = [{**m, "content": _chat_content(m.get("content"))} for m in messages]
        if tools := _chat_tools(body.get("tools")):
            chat["tools"] = tools
            if (choice := _chat_tool_choice(body.get("tool_choice"))) is not None:
                chat["tool_choice"] = choice
        if request.max_output_tokens:
            chat["max_completion_tokens"] = request.max_output_tokens
        return chat

    async def send(
        self, handler: Any, body: dict[str, Any], request: ChatCompletionRequest, raw_request: Request
    ) -> Any:
        instructions, items = response_items(chat_messages(request))
        sent = {k: v for k, v in body.items() if not k.startswith("pamer_") and k != "previous_response_id"}
        sent.update(input=items, instructions=instructions, vllm_xargs=request.vllm_xargs)
        answer = await handler.create_responses(responses_request(sent), raw_request)
        if hasattr(answer, "output"):
            await self._hold(answer)
        return answer

    async def _hold(self, answer: Any) -> None:
        """Holds a finished answer with what its request added; a failure
        is logged (the answer is sent; a later turn that continues it is
        answered by vLLM as sent)."""
        if self.held_by is None or getattr(answer, "status", None) not in HELD_STATUSES:
            return
        store, key = self.held_by
        name = self.session_name or answer.id  # a conversation without a session is its first answer's
        items = [*self.added, *responses_output_messages(answer)]
        try:
            await store.hold_response(key(answer.id), self.parent, (key(name), name), items, responses_content(answer))
        except StoreError:
            logger.warning("vllm-pamer: response %s could not be held", answer.id, exc_info=True)

    async def pass_through(self, handler: Any, body: dict[str, Any], raw_request: Request) -> Any:
        return await handler.create_responses(responses_request(body), raw_request)

    async def respond(self, answer: Any, report: ReportMaker | None, headers: dict[str, str]) -> Response:
        if not hasattr(answer, "__aiter__"):
            content = responses_content(answer)
            if report is not None:
                content["pamer"] = await report()
            return JSONResponse(content=content, headers=headers)
        return StreamingResponse(self._events(answer, report), media_type="text/event-stream", headers=headers)

    async def _events(self, answer: AsyncIterator[Any], report: ReportMaker | None) -> AsyncIterator[str]:
        """vLLM's events as its route writes them; the completed response
        carries the report and is held."""
        async for event in answer:
            kind, data = responses_event(event)
            if kind == "response.completed":
                await self._hold(getattr(event, "response", None))
                if report is not None and isinstance(data.get("response"), dict):
                    data["response"]["pamer"] = await report()
            yield f"event: {kind}\ndata: {json.dumps(data)}\n\n"
