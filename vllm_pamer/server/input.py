"""Input processing of the plugin's chat route: the client's request, checked
as vLLM would check it before any memory operation (a refused request starts
no compression and creates no session), and the request handed to vLLM after
the rewrite."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from vllm_pamer.adapters.serving import REQUEST_ERRORS, ChatCompletionRequest, template_tools, validate_chat_request
from vllm_pamer.channel import CAPTURE_KEY, SESSION_KEY
from vllm_pamer.core.blocks import MalformedRequest, check_message_shape
from vllm_pamer.core.policies import MemoryPolicy, PolicyDecision, PolicyRequest, UnknownPolicy
from vllm_pamer.server.access import BadSessionId, PolicyRefused, check_session_id, header_text
from vllm_pamer.server.output import PamerReport
from vllm_pamer.server.sessions import SessionState
from vllm_pamer.server.state import ServerState
from vllm_pamer.server.tool_rounds import offered_tools
from vllm_pamer.settings import Settings

POLICY_HEADER = "x-pamer-policy"
ECHO_HEADER = "x-pamer-echo"
BUDGET_HEADER = "x-pamer-context-budget"


MAX_DEPTH = 64
"""Deepest nesting of a request body the plugin reads (a chat request with
tools and JSON schemas nests far less; vLLM's validation recurses)."""


class InputError(Exception):
    """A request the plugin refuses with an OpenAI-style error."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


@dataclass
class ChatInput:
    """One client request, checked: what the rewrite reads (``request``) and
    what the route needs around it."""

    body: dict[str, Any]
    """The body without the plugin's own fields (``pamer_policy``, ``pamer_echo``)."""
    request: PolicyRequest
    """The request as the pipeline reads it: the messages, the session's key
    (``server/access.py``: the id within the caller's tenant; empty: none
    named), the tools as the template renders them, the prompt tokens as
    received, the context budget and answer length it asks for. The route adds
    what the server remembers of the session."""
    policy: MemoryPolicy
    echo: bool
    template_kwargs: dict[str, Any] | None
    xargs: dict[str, Any] = field(default_factory=dict)
    """The client's own ``vllm_xargs``."""
    exclude_tools: bool = False
    """The server runs with ``--exclude-tools-when-tool-choice-none``."""
    own_tools: list[dict] = field(default_factory=list)
    """The policy's own tools offered on this request (set by ``outgoing``)."""
    session_name: str | None = None
    """The session id as the client sent it."""
    stored_session: SessionState | None = None
    """The session's state from the store where it is newer than this
    process's (``ServerState.newer_stored``), read once per request."""


async def read_body(raw_request: Request, limit: int) -> dict[str, Any]:
    """The request's JSON object; HTTP 413 past ``limit`` bytes, read no further."""
    declared = raw_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise InputError(f"request body of {declared} bytes is over this server's limit of {limit}", 413)
    data = bytearray()
    async for chunk in raw_request.stream():
        data += chunk
        if len(data) > limit:
            raise InputError(f"request body is over this server's limit of {limit} bytes", 413)
    try:
        body = json.loads(bytes(data))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InputError("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InputError("request body must be a JSON object")
    if _depth(body) > MAX_DEPTH:
        raise InputError(f"request body is nested more than {MAX_DEPTH} levels deep")
    return body


def _depth(value: Any) -> int:
    """How deep JSON ``value`` nests (counted without recursion: later checks recurse)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


async def read_chat(body: dict[str, Any], raw_request: Request, state: ServerState) -> ChatInput:
    """The client's request checked; its prompt tokens counted off the event
    loop (the policy's window guard needs no count of its own while it fits)."""
    try:
        messages = check_message_shape(body.get("messages"))
    except MalformedRequest as exc:
        raise InputError(str(exc)) from None
    try:
        session_name = session_id_of(session_header(raw_request.headers, state.settings), body.get("session_id"))
        session_id = state.access.session_key(raw_request.headers, session_name) if session_name else None
    except BadSessionId as exc:
        raise InputError(str(exc)) from None
    policy_name = raw_request.headers.get(POLICY_HEADER) or body.pop("pamer_policy", None)
    echo = raw_request.headers.get(ECHO_HEADER, "") in ("1", "true") or bool(body.pop("pamer_echo", False))
    xargs = body.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        raise InputError("vllm_xargs must be an object")
    # the plugin's own keys (capture, session) are the server's to set
    xargs = {k: v for k, v in xargs.items() if k not in (CAPTURE_KEY, SESSION_KEY)}
    context_budget = context_budget_of(raw_request.headers.get(BUDGET_HEADER), body.pop("pamer_context_budget", None))
    try:
        policy = state.policy(policy_name) if policy_name else state.default_policy
    except (UnknownPolicy, ValueError) as exc:
        raise InputError(str(exc)) from None
    stored = await state.newer_stored(session_id) if session_id else None  # another process's state too
    known = stored or (state.sessions.get(session_id) if session_id else None)
    try:
        state.access.check_policy(policy.name, known.policy if known is not None else None)
    except PolicyRefused as exc:
        raise InputError(str(exc), exc.status) from None
    try:
        received = validate_chat_request(body)
    except REQUEST_ERRORS as exc:
        raise InputError(f"invalid chat completion request: {exc}") from None
    exclude_tools = bool(getattr(state.args, "exclude_tools_when_tool_choice_none", False))
    tools_in = template_tools(received.tools, received.tool_choice, exclude_tools)
    prompt_tokens_in = None  # a policy that never rewrites: the engine's count, from the capture
    if policy.counts_prompt:
        prompt_tokens_in = await asyncio.to_thread(
            state.prompt_tokens, state.render(messages), received.chat_template_kwargs, tools_in
        )
    request = PolicyRequest(
        messages=messages,
        session_id=session_id or "",
        tools=tools_in,
        prompt_tokens=prompt_tokens_in,
        context_budget=context_budget,
        answer_tokens=received.max_completion_tokens or received.max_tokens,
    )
    return ChatInput(
        body,
        request,
        policy,
        echo,
        received.chat_template_kwargs,
        xargs=dict(xargs),
        exclude_tools=exclude_tools,
        session_name=session_name,
        stored_session=stored,
    )


def session_header(headers: Mapping[str, str], settings: Settings) -> str | None:
    """The first header that names a session (``Settings.session_header_names``)."""
    for name in settings.session_header_names:
        if value := headers.get(name):
            return value
    return None


def session_id_of(header: str | None, field: Any) -> str | None:
    """The session the request names: the header, else the body's ``session_id``."""
    raw = header_text(header) if header else field
    return None if raw is None or raw == "" else check_session_id(raw)


def context_budget_of(header: str | None, field: Any) -> int | None:
    """The request's own context budget: a positive whole number of tokens."""
    raw = header if header is not None else field
    if raw is None:
        return None
    try:
        budget = int(raw)
    except (TypeError, ValueError):
        budget = 0
    if budget <= 0 or isinstance(raw, (bool, float)):
        raise InputError(f"the context budget must be a positive number of tokens, not {raw!r}")
    return budget


def outgoing(
    chat: ChatInput, outcome: PolicyDecision, state: ServerState, report: PamerReport, own_tools: bool = True
) -> tuple[ChatCompletionRequest, str]:
    """The request vLLM serves: the rewritten messages rendered for the
    template, the policy's own tools where they can be answered (``own_tools``:
    the API's answers are chat answers), and a capture key in ``vllm_xargs``.
    Returns it and the capture key."""
    body = chat.body
    client_tools = body.get("tools") or []
    auto_tools = bool(getattr(state.args, "enable_auto_tool_choice", False))
    if own_tools:
        chat.own_tools = offered_tools(outcome.extra_tools, body, client_tools, report, auto_tools)
    elif outcome.extra_tools:
        report.note("the policy's own tools are offered on chat completions only")
    if chat.own_tools:
        body["tools"] = list(client_tools) + chat.own_tools
    capture_key = state.inbox.new_key()
    body["vllm_xargs"] = {**chat.xargs, CAPTURE_KEY: capture_key, SESSION_KEY: chat.request.session_id}
    body["messages"] = state.render(outcome.messages)
    try:
        return validate_chat_request(body), capture_key
    except REQUEST_ERRORS as exc:
        raise InputError(f"invalid chat completion request: {exc}") from None


def tools_out(request: ChatCompletionRequest, chat: ChatInput) -> list[dict] | None:
    """The sent request's tools (the policy's own after the client's) as the
    template renders them."""
    return template_tools(request.tools, request.tool_choice, chat.exclude_tools)
