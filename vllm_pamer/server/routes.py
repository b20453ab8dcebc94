"""The routes the plugin adds to vLLM's API server.

``POST /v1/chat/completions``, ``POST /v1/responses``, ``POST
/v1/messages`` and the chat and Responses bodies of ``POST /invocations`` (replacing vLLM's
own; each API's differences are ``apis.py``'s and ``responses.py``'s), per
request:
1. input (``input.py``): parse and check the body as vLLM would (HTTP 400
   before any memory operation), as a chat request; find the session and the
   policy, count the prompt;
2. rewrite (``core/pipeline.py``: any failure sends the original messages);
3. hand vLLM's own handler of that API the rewritten request, tagged with a
   capture key; answer the policy's own tool calls (``tool_rounds.py``);
4. output (``output.py``): vLLM's answer in the API's shape, the ``pamer``
   report on it and ``X-Pamer-*`` headers.

``GET /pamer/sessions/{id}``: a session's state, memories and event log
(read-only; the caller's own sessions; off with ``session_routes``; 503 when
the store cannot be read).

Every route here answers 401 without a valid key when the server has keys
(``access.py``), the dependency of the router.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Message

from vllm_pamer.adapters.serving import REQUEST_ERRORS, is_error, with_cancellation
from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.store import StoreError
from vllm_pamer.server import metrics
from vllm_pamer.server.access import BadSessionId, check_session_id
from vllm_pamer.server.apis import CHAT, MESSAGES, ManagedApi, PassThrough, UnreadableBody
from vllm_pamer.server.input import InputError, outgoing, read_body, read_chat, tools_out
from vllm_pamer.server.output import PamerReport, error_response, finish_report, report_headers
from vllm_pamer.server.responses import ResponsesApi
from vllm_pamer.server.state import ServerState
from vllm_pamer.server.tool_rounds import resolve_own_tool_calls
from vllm_pamer.server.unmanaged import mark_managed

REWRITING_ACTIONS = ("rewritten", "compressed", "recalled")


def authorized(raw_request: Request) -> None:
    """Raises ``access.Unauthorized`` (answered 401 as vLLM answers it) without a valid key."""
    state: ServerState = raw_request.app.state.pamer
    state.access.authorize(raw_request.headers)


router = APIRouter(dependencies=[Depends(authorized)])
open_router = APIRouter()
"""Routes vLLM serves without a key (``/invocations``, SageMaker's): they check it where they manage."""


@router.post("/v1/chat/completions")
async def chat_completions(raw_request: Request) -> Response:
    return await _managed(CHAT, raw_request)


@router.post("/v1/messages")
async def messages(raw_request: Request) -> Response:
    return await _managed(MESSAGES, raw_request)


@router.post("/v1/responses")
async def responses(raw_request: Request) -> Response:
    return await _managed(ResponsesApi(), raw_request)  # one per request: it holds the history it continues


@open_router.post("/invocations")
async def invocations(raw_request: Request) -> Response:
    """SageMaker's route, where vLLM serves chat and completion bodies: a chat
    body is managed as on chat completions, a Responses body (``input``, no
    ``prompt``) as on ``/v1/responses`` (vLLM 0.32 serves none there; a
    generating model's server does here), a key needed for both where the
    server has keys; any other body goes to vLLM's own handler as sent."""
    try:
        body = await read_body(raw_request, raw_request.app.state.pamer.settings.max_request_bytes)
    except InputError as exc:
        return CHAT.error(exc.status, exc.message)
    api = invocation_api(raw_request, body)
    if api is not None:
        authorized(raw_request)
        mark_managed(raw_request.scope)
        return await _serve(api, raw_request, body)
    own = vllm_route(raw_request, "/invocations", "POST")
    if own is None:
        return CHAT.error(404, "this server serves only chat bodies on /invocations")
    return await own(replayed(raw_request, json.dumps(body).encode()))


def invocation_api(raw_request: Request, body: dict[str, Any]) -> ManagedApi | None:
    """The managed API an ``/invocations`` body speaks (None: vLLM's to serve).
    An embedding body also has ``input``: it is a Responses body only where
    the server generates (vLLM serves the Responses API)."""
    if isinstance(body.get("messages"), list):
        return CHAT
    if "input" in body and "prompt" not in body and getattr(raw_request.app.state, ResponsesApi.handler, None):
        return ResponsesApi()
    return None


@router.get("/v1/responses/{response_id}")
async def retrieve_response(
    response_id: str, raw_request: Request, starting_after: int | None = None, stream: bool | None = False
) -> Response:
    """A response the plugin holds for the caller's tenant (``responses.py``),
    else vLLM's own answer (its store, or 404)."""
    state: ServerState = raw_request.app.state.pamer
    try:
        held = await state.store.held_response(state.access.session_key(raw_request.headers, response_id))
    except StoreError as exc:
        return error_response(503, f"the memory store could not be read: {exc}")
    if held is not None and not stream:
        return JSONResponse(content=held.response)
    own = vllm_route(raw_request, "/v1/responses/{response_id}", "GET")
    if own is None:
        return error_response(404, f"no response {response_id!r}")
    return await own(response_id, raw_request, starting_after=starting_after, stream=stream)


DELEGATED = {("/invocations", "POST"), ("/v1/responses/{response_id}", "GET")}
"""vLLM's routes the plugin replaces and hands what it does not serve itself."""
VLLM_ROUTES = "pamer_vllm_routes"
"""The ``app.state`` attribute: vLLM's handlers of ``DELEGATED`` (``app.py``)."""


def vllm_route(raw_request: Request, path: str, method: str) -> Any:
    """vLLM's own handler of a route the plugin replaced (None: vLLM has none)."""
    return getattr(raw_request.app.state, VLLM_ROUTES, {}).get((path, method))


def replayed(raw_request: Request, body: bytes) -> Request:
    """The request again, its body ``body`` (the plugin has read the original)."""
    given = False

    async def receive() -> Message:
        nonlocal given
        if given:
            return await raw_request.receive()  # a disconnect, as the original would tell
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(raw_request.scope, receive)


async def _managed(api: ManagedApi, raw_request: Request) -> Response:
    try:
        body = await read_body(raw_request, raw_request.app.state.pamer.settings.max_request_bytes)
    except InputError as exc:
        return api.error(exc.status, exc.message)
    return await _serve(api, raw_request, body)


@with_cancellation  # it takes its second argument for the request whose disconnect cancels
async def _serve(api: ManagedApi, raw_request: Request, body: dict[str, Any]) -> Response:
    state: ServerState = raw_request.app.state.pamer
    received = time.monotonic()
    handler = getattr(raw_request.app.state, api.handler, None)
    if handler is None:
        return api.error(501, f"the served model does not support the {api.name} API", "NotImplementedError")
    try:
        chat = await read_chat(await api.chat_body(body, handler, raw_request), raw_request, state)
    except UnreadableBody as exc:
        return api.error(400, str(exc))
    except PassThrough as exc:
        return await _pass_through(api, handler, body, raw_request, Fallback(str(exc)))
    except InputError as exc:
        return api.error(exc.status, exc.message)
    key = chat.request.session_id
    session = state.sessions.touch(key, chat.stored_session) if key else None
    asked = msgspec.structs.replace(chat.request, context=state.context)
    if session is not None:
        session.policy = chat.policy.name
        asked = msgspec.structs.replace(
            asked,
            previous_vote=session.last_vote,
            previous_state=session.state(),
            previous_recall=session.last_recall,
        )
    rewriting = time.monotonic()
    outcome = await rewrite_request(chat.policy, asked)
    schedule = outcome.schedule
    if schedule is not None and schedule.memory_seconds is not None:  # written ahead, or waited for
        mode = "ahead" if schedule.memory_ahead else "inline"
        metrics.MEMORY_WRITE.labels(chat.policy.name, mode).observe(schedule.memory_seconds)
    elif outcome.action == "compressed":  # a policy without a schedule report: the request waited
        metrics.MEMORY_WRITE.labels(chat.policy.name, "inline").observe(time.monotonic() - rewriting)
    report = PamerReport(
        session_id=chat.session_name,
        policy=chat.policy.name,
        action=outcome.action,
        detail=outcome.detail,
        recalled=list(outcome.recalled) if outcome.recalled is not None else None,
        messages_sent=outcome.messages if chat.echo else None,
        prompt_tokens_in=asked.prompt_tokens,
        schedule=msgspec.to_builtins(outcome.schedule) if outcome.schedule is not None else None,
        api=api.name,
    )
    metrics.REQUESTS.labels(chat.policy.name, metrics.action_label(outcome.action)).inc()
    metrics.TOKENS_INSERTED.inc(outcome.tokens_inserted)
    if outcome.schedule is not None and outcome.schedule.trigger is not None:
        metrics.COMPACTIONS.labels(chat.policy.name, outcome.schedule.trigger).inc()
        metrics.CACHE_BREAK_TOKENS.inc(outcome.schedule.cache_break_tokens)
    if session is not None:  # before the capture stores the session: every API process reads this request
        session.requests += 1
        session.last_action = outcome.action
        if outcome.schedule is not None:
            session.last_schedule = msgspec.to_builtins(outcome.schedule)
    try:
        request, capture_key = outgoing(chat, outcome, state, report, api.own_tools)
    except InputError as exc:
        return api.error(exc.status, exc.message)
    rewritten = outcome.action in REWRITING_ACTIONS
    if rewritten or chat.own_tools:
        report.prompt_tokens_out = await asyncio.to_thread(
            state.prompt_tokens, chat.body["messages"], chat.template_kwargs, tools_out(request, chat)
        )
    else:
        report.prompt_tokens_out = asked.prompt_tokens
    if rewritten and report.prompt_tokens_in and report.prompt_tokens_out:
        metrics.PROMPT_TOKENS_REMOVED.inc(max(0, report.prompt_tokens_in - report.prompt_tokens_out))

    metrics.REQUEST_WAIT.labels(chat.policy.name).observe(time.monotonic() - received)
    # The capture arrives when the prompt prefill completes, long before the
    # response ends: file the vote on the session right then.
    capture_task = asyncio.create_task(state.on_capture(capture_key, session, chat.policy))
    try:
        result = await api.send(handler, body, request, raw_request)
    except REQUEST_ERRORS as exc:  # the rewritten view in the API's own shape failed vLLM's check
        capture_task.cancel()
        state.inbox.forget(capture_key)
        return api.error(400, f"invalid {api.name} request after the rewrite: {exc}")
    except BaseException:
        capture_task.cancel()
        raise
    if chat.own_tools and not is_error(result):
        names = {tool["function"]["name"] for tool in chat.own_tools}
        result, rounds = await resolve_own_tool_calls(
            state, chat.policy, key or None, chat.body, outcome.messages, result, raw_request, names, chat.xargs
        )
        if rounds:
            report.note(f"resolved {rounds} {'/'.join(sorted(names))} tool round(s)")
    if is_error(result):
        capture_task.cancel()
        state.inbox.forget(capture_key)
        return api.error_from(result)
    return await api.respond(
        result,
        lambda: finish_report(report, capture_task, state.settings.capture_wait_s, chat.echo),
        report_headers(report),
    )


async def _pass_through(
    api: ManagedApi, handler: Any, body: dict[str, Any], raw_request: Request, rule: Fallback
) -> Response:
    """vLLM answers the client's body as sent: no memory, no session state;
    the ``X-Pamer-Action`` header and the metrics name the rule."""
    body = {k: v for k, v in body.items() if not k.startswith("pamer_")}
    try:
        result = await api.pass_through(handler, body, raw_request)
    except REQUEST_ERRORS as exc:
        return api.error(400, f"invalid {api.name} request: {exc}")
    metrics.REQUESTS.labels("none", rule.action).inc()
    if is_error(result):
        refused = api.error_from(result)
        refused.headers["X-Pamer-Action"] = rule.action
        return refused
    return await api.respond(result, None, {"X-Pamer-Action": rule.action})


SESSION_EVENTS = 100
"""The session route's newest events shown, unless ``?events=N`` asks for
another number (more than the store keeps of a session: all it keeps)."""


@router.get("/pamer/sessions/{session_id}")
async def session_info(session_id: str, raw_request: Request) -> Response:
    state: ServerState = raw_request.app.state.pamer
    if not state.settings.session_routes:
        return error_response(404, "the session routes are off on this server")
    try:
        key = state.access.session_key(raw_request.headers, check_session_id(session_id))
    except BadSessionId as exc:
        return error_response(400, str(exc))
    shown = raw_request.query_params.get("events", str(SESSION_EVENTS))
    if not (shown.isascii() and shown.isdigit() and len(shown) <= 9 and int(shown) >= 1):
        return error_response(400, f"events must be a whole number of at least 1, not {shown!r}")
    try:
        session = await state.peek_session(key)
        loaded = await state.store.load(key)
        events = (
            await state.store.events(key, min(int(shown), state.settings.store_limits.session_events))
            if session is not None or loaded.memories
            else []
        )
    except StoreError as exc:  # the store's fault, not the caller's: they may retry
        return error_response(503, f"the memory store could not be read: {exc}")
    if session is None and not loaded.memories:
        return error_response(404, f"no session {session_id!r}")
    content: dict[str, Any] = session.summary() if session is not None else {}
    if session is not None and session.policy in state.policies_made():
        content["memory_in_flight"] = state.policy(session.policy).in_flight(key)
    content["session_id"] = session_id
    content["memories"] = [m.public() for m in loaded.memories]
    content["events"] = events
    return JSONResponse(content=content)
