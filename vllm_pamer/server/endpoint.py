"""API-server glue: the endpoint plugin that takes over chat completions.

For each ``POST /v1/chat/completions``:
1. parse and check the body as vLLM would (malformed JSON, messages or any
   other field: HTTP 400, before any memory operation),
2. find the session (``X-Session-ID`` header or ``session_id`` field) and the
   policy (server default, or ``X-Pamer-Policy`` / ``pamer_policy`` field),
3. rewrite the messages (``core.pipeline``: fallbacks return them unchanged),
4. tag the request with a capture key in ``vllm_xargs`` and hand it to vLLM's
   own chat handler,
5. attach the ``pamer`` report (capture, head logits, vote, action, prompt
   tokens before and after) to the response, or to a last streamed chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from argparse import Namespace
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionToolsParam
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.utils.api_utils import with_cancellation
from vllm.exceptions import VLLMClientError

from vllm_pamer.channel import CAPTURE_KEY, SESSION_KEY, CaptureInbox, CaptureRecord, ensure_channel_address
from vllm_pamer.config import PamerConfig
from vllm_pamer.core.blocks import MalformedRequest, check_message_shape
from vllm_pamer.core.pipeline import RewriteOutcome, rewrite_request
from vllm_pamer.core.policies import MemoryPolicy, UnknownPolicy, create_variant, policy_class
from vllm_pamer.core.memory_store import MemoryStore
from vllm_pamer.core.policies.pamer import PamerContext
from vllm_pamer.core.render import render_tools_as_text, template_supports_tools
from vllm_pamer.default_model import cache_root
from vllm_pamer.embedders import DEFAULT_EMBEDDER, make_embedder
from vllm_pamer.server.engine_services import EngineServices
from vllm_pamer.server import metrics
from vllm_pamer.server.sessions import SessionRegistry, SessionState

logger = logging.getLogger("vllm_pamer.endpoint")

SESSION_HEADER = "x-session-id"
POLICY_HEADER = "x-pamer-policy"
ECHO_HEADER = "x-pamer-echo"
REWRITING_ACTIONS = ("rewritten", "compressed", "recalled")
MAX_OWN_TOOL_ROUNDS = 3  # memory-tool calls answered per request before the answer goes back
CAPTURE_LIFETIME_S = 3600.0  # a request may wait long in the queue before its prefill


def error_response(status: int, message: str, err_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": err_type, "param": None, "code": status}},
    )


class PamerReport(msgspec.Struct):
    """The ``pamer`` object of every chat completion response."""

    session_id: str | None
    policy: str
    action: str
    captured: bool = False
    head_logits: list[float] | None = None
    votes: int | None = None
    compress_vote: bool | None = None
    prompt_tokens_in: int | None = None
    prompt_tokens_out: int | None = None
    detail: str = ""
    recalled: list[int] | None = None
    """Ids of the memories shown, in order (None: this request recalled nothing)."""
    messages_sent: list[dict] | None = None
    """The rewritten messages, only when asked for (``X-Pamer-Echo: 1`` or
    ``"pamer_echo": true``): what the policy sent, before tools-as-text rendering."""

    def add_capture(self, record: CaptureRecord | None) -> None:
        self.captured = record is not None
        if record is not None:
            self.head_logits = record.head_logits
            self.votes = record.votes
            self.compress_vote = record.decision
            if record.heads_error:
                self.detail = (self.detail + "; " if self.detail else "") + f"heads: {record.heads_error}"


class PamerServer:
    """Plugin state on ``app.state.pamer``."""

    def __init__(self, config: PamerConfig, engine_client: Any, args: Namespace) -> None:
        self.config = config
        self.engine_client = engine_client
        self.args = args
        self.sessions = SessionRegistry()
        self.inbox = CaptureInbox(ensure_channel_address())
        self.has_heads = bool(config.heads)
        self._policies: dict[str, MemoryPolicy] = {}
        self.default_policy = self.policy(config.default_policy, config.policy_options)
        tokenizer = engine_client.renderer.get_tokenizer()
        self.tokenizer = tokenizer
        self.tools_as_text = not template_supports_tools(getattr(tokenizer, "chat_template", None))
        model_config = engine_client.model_config
        store_path = config.store or str(cache_root() / "memory.sqlite3")
        self.store = MemoryStore(store_path, model_fingerprint=str(model_config.served_model_name or model_config.model))
        embedder = None
        if config.embedder != DEFAULT_EMBEDDER:
            embedder = make_embedder(config.embedder, check=True).load()  # load now, not on a request
        self.services = EngineServices(
            engine_client, tokenizer, self.inbox, model_config.max_model_len, embedder=embedder, render=self.render
        )
        self.memory = PamerContext(self.store, self.services)
        self.sessions.on_evict = self.services.index.drop_session

    def policy(self, name: str, options: dict | None = None) -> MemoryPolicy:
        """The policy instance for ``name`` (created once; raises UnknownPolicy)."""
        if name not in self._policies:
            if options is None:
                options = self.config.options_by_policy.get(name)
            cls = policy_class((options or {}).get("policy", name))
            if cls.requires_heads and not self.has_heads:
                raise UnknownPolicy(
                    f"policy {name!r} needs a heads file for the served model "
                    "(--pamer-heads); none is loaded"
                )
            self._policies[name] = create_variant(name, options)
        return self._policies[name]

    async def on_capture(self, key: str, session: SessionState | None, policy: MemoryPolicy) -> CaptureRecord | None:
        """Wait for a request's capture; file its vote on the session and let
        the policy act on it (e.g. start a summary while the agent works)."""
        record = await self.inbox.wait_for(key, CAPTURE_LIFETIME_S)
        if record is not None and session is not None:
            session.record_capture(record)
            if session.last_vote is not None:
                try:
                    await policy.on_vote(session.session_id, session.last_vote, self.memory)
                except Exception:
                    logger.exception("policy %s failed to act on a vote", policy.name)
        return record

    def count_prompt_tokens(
        self, messages: list[dict], template_kwargs: dict | None = None, tools: list[dict] | None = None
    ) -> int | None:
        """Prompt tokens of a chat request, as the engine will count them:
        ``tools`` as vLLM hands them to the template (``template_tools``)."""
        try:
            return self.services.request_tokens(messages, tools, template_kwargs)
        except Exception:
            logger.debug("token count failed", exc_info=True)
            return None

    def render(self, messages: list[dict]) -> list[dict]:
        return render_tools_as_text(messages) if self.tools_as_text else messages


router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(raw_request: Request):
    server: PamerServer = raw_request.app.state.pamer
    try:
        body = json.loads(await raw_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return error_response(400, f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object")
    return await _handle_chat(body, raw_request)


@with_cancellation
async def _handle_chat(body: dict, raw_request: Request):
    server: PamerServer = raw_request.app.state.pamer
    try:
        messages = check_message_shape(body.get("messages"))
    except MalformedRequest as exc:
        return error_response(400, str(exc))

    session_id = raw_request.headers.get(SESSION_HEADER) or body.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        return error_response(400, "session_id must be a string")
    policy_name = raw_request.headers.get(POLICY_HEADER) or body.pop("pamer_policy", None)
    echo = raw_request.headers.get(ECHO_HEADER, "") in ("1", "true") or bool(body.pop("pamer_echo", False))
    try:
        policy = server.policy(policy_name) if policy_name else server.default_policy
    except (UnknownPolicy, ValueError) as exc:
        return error_response(400, str(exc))

    # The request as the client sent it is checked before any memory
    # operation, so a request vLLM would refuse starts no compression.
    try:
        received = ChatCompletionRequest.model_validate(body)
    except (ValidationError, VLLMClientError) as exc:
        return error_response(400, f"invalid chat completion request: {exc}")
    exclude_tools = bool(getattr(server.args, "exclude_tools_when_tool_choice_none", False))
    template_kwargs = received.chat_template_kwargs
    tools_in = template_tools(received.tools, received.tool_choice, exclude_tools)
    # Counted off the event loop, before the policy runs: its window guard
    # needs no count of its own while the request fits.
    prompt_tokens_in = await asyncio.to_thread(
        server.count_prompt_tokens, server.render(messages), template_kwargs, tools_in
    )
    session = server.sessions.touch(session_id) if session_id else None
    outcome: RewriteOutcome = await rewrite_request(
        messages, session_id, policy, session.last_vote if session else None, server.memory,
        session.state() if session else None, tools_in, prompt_tokens_in,
    )
    rewritten = outcome.action in REWRITING_ACTIONS
    sent = server.render(outcome.messages)
    report = PamerReport(
        session_id=session_id,
        policy=policy.name,
        action=outcome.action,
        detail=outcome.detail,
        recalled=list(outcome.recalled) if outcome.recalled is not None else None,
        messages_sent=outcome.messages if echo else None,
    )
    metrics.REQUESTS.labels(policy.name, metrics.action_label(outcome.action)).inc()
    metrics.TOKENS_INSERTED.inc(outcome.tokens_inserted)

    capture_key = uuid.uuid4().hex
    xargs = body.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        return error_response(400, "vllm_xargs must be an object")
    auto_tools = bool(getattr(server.args, "enable_auto_tool_choice", False))
    client_tools = body.get("tools") or []
    own_tools = _offered_tools(outcome.extra_tools, body, client_tools, report, auto_tools)
    if own_tools:
        body["tools"] = list(client_tools) + own_tools
    body["vllm_xargs"] = {**xargs, CAPTURE_KEY: capture_key, SESSION_KEY: session_id or ""}
    body["messages"] = sent
    try:
        request = ChatCompletionRequest.model_validate(body)
    except (ValidationError, VLLMClientError) as exc:
        return error_response(400, f"invalid chat completion request: {exc}")
    report.prompt_tokens_in = prompt_tokens_in
    if rewritten or own_tools:
        # Counted on the validated request: its tools (the policy's own
        # appended after the client's) render as the engine renders them.
        tools_out = template_tools(request.tools, request.tool_choice, exclude_tools)
        report.prompt_tokens_out = await asyncio.to_thread(server.count_prompt_tokens, sent, template_kwargs, tools_out)
    else:
        report.prompt_tokens_out = prompt_tokens_in
    if rewritten and report.prompt_tokens_in and report.prompt_tokens_out:
        metrics.PROMPT_TOKENS_REMOVED.inc(max(0, report.prompt_tokens_in - report.prompt_tokens_out))

    handler = raw_request.app.state.openai_serving_chat
    if handler is None:
        return error_response(501, "the served model does not support chat completions", "NotImplementedError")
    # The capture arrives when the prompt prefill completes, long before the
    # response ends: file the vote on the session right then.
    capture_task = asyncio.create_task(server.on_capture(capture_key, session, policy))
    try:
        result = await handler.create_chat_completion(request, raw_request)
    except BaseException:
        capture_task.cancel()
        raise
    if own_tools and not isinstance(result, ErrorResponse):
        names = {tool["function"]["name"] for tool in own_tools}
        result, rounds = await _resolve_own_tool_calls(
            server, policy, session_id, body, outcome.messages, result, raw_request, names, xargs
        )
        if rounds:
            report.detail += f"; resolved {rounds} {'/'.join(sorted(names))} tool round(s)"

    async def finish_report() -> dict:
        try:
            record = await asyncio.wait_for(asyncio.shield(capture_task), server.config.capture_wait_s)
        except asyncio.TimeoutError:
            capture_task.cancel()
            record = None
        report.add_capture(record)
        if record is not None:
            metrics.CAPTURES.inc()
        else:
            metrics.MISSED_CAPTURES.inc()
        if session is not None:
            session.requests += 1
            session.last_action = outcome.action
        reported = msgspec.to_builtins(report)
        if not echo:
            reported.pop("messages_sent")
        return reported

    if isinstance(result, ErrorResponse):
        capture_task.cancel()
        server.inbox.forget(capture_key)
        return JSONResponse(content=result.model_dump(), status_code=result.error.code)
    if not hasattr(result, "__aiter__"):
        content = result.model_dump()
        content["pamer"] = await finish_report()
        return JSONResponse(content=content)

    async def stream():
        last_id = None
        async for chunk in result:
            if chunk.startswith("data: [DONE]"):
                pamer = await finish_report()
                final = {"id": last_id, "object": "chat.completion.chunk", "choices": [], "pamer": pamer}
                yield f"data: {json.dumps(final)}\n\n"
            elif last_id is None and chunk.startswith("data: {"):
                try:
                    last_id = json.loads(chunk[6:]).get("id")
                except json.JSONDecodeError:
                    pass
            yield chunk

    return StreamingResponse(stream(), media_type="text/event-stream")


def template_tools(
    tools: list[ChatCompletionToolsParam] | None, tool_choice: Any, exclude_when_choice_none: bool
) -> list[dict] | None:
    """A request's tools as vLLM's renderer passes them to the chat template
    (``OnlineRenderer``: none when ``tool_choice`` is "none" and the server runs
    with ``--exclude-tools-when-tool-choice-none``)."""
    if not tools or (tool_choice == "none" and exclude_when_choice_none):
        return None
    return [tool.model_dump() for tool in tools]


def _offered_tools(extra_tools, body: dict, client_tools: list, report: PamerReport, auto_tools: bool) -> list[dict]:
    """The policy's own tools to add to this request: non-streaming only (the
    server must read the whole answer to resolve a call), not when the client
    turned tools off or already has a tool of that name, and, when the client
    leaves the choice to the model, only if the server parses tool calls
    (``--enable-auto-tool-choice``; vLLM refuses "auto" otherwise)."""
    if not extra_tools or body.get("stream") or body.get("tool_choice") == "none":
        return []
    if body.get("tool_choice") in (None, "auto") and not auto_tools:
        report.detail += "; memory tool not offered: the server runs without --enable-auto-tool-choice"
        return []
    taken = {t.get("function", {}).get("name") for t in client_tools if isinstance(t, dict)}
    clashes = [t["function"]["name"] for t in extra_tools if t["function"]["name"] in taken]
    if clashes:
        report.detail += f"; tool {clashes} not offered: the client has a tool of that name"
    return [dict(t) for t in extra_tools if t["function"]["name"] not in taken]


async def _resolve_own_tool_calls(server, policy, session_id, body, messages, result, raw_request, names, xargs):
    """Answer the model's calls of the policy's own tools and continue the
    generation, up to MAX_OWN_TOOL_ROUNDS; the client gets the final answer
    with only its own tool calls. Returns (result, rounds)."""
    handler = raw_request.app.state.openai_serving_chat
    rounds = 0
    while not isinstance(result, ErrorResponse):
        message = result.choices[0].message
        calls = message.tool_calls or []
        ours = [c for c in calls if c.function.name in names]
        if not ours or len(ours) < len(calls) or rounds == MAX_OWN_TOOL_ROUNDS:
            break
        if result.usage is not None:  # an intermediate round is the plugin's cost
            metrics.INTERNAL_PROMPT_TOKENS.labels("tool_round").inc(result.usage.prompt_tokens)
            metrics.INTERNAL_COMPLETION_TOKENS.labels("tool_round").inc(result.usage.completion_tokens or 0)
        answers = []
        for call in ours:
            try:
                content = await policy.resolve_tool_call(session_id, call.function.name, call.function.arguments, server.memory)
            except Exception as exc:  # the model reads the error; nothing of the request is lost
                logger.exception("policy %s failed to resolve %s", policy.name, call.function.name)
                content = f"{call.function.name} error: {type(exc).__name__}"
            answers.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": content})
        assistant = {"role": "assistant", "content": message.content, "tool_calls": [c.model_dump() for c in ours]}
        messages = list(messages) + [assistant] + answers
        follow = {**body, "messages": server.render(messages), "vllm_xargs": {**xargs, SESSION_KEY: ""}}
        if isinstance(body.get("tool_choice"), dict):  # a forced call of our tool is answered once
            follow["tool_choice"] = "none"
        result = await handler.create_chat_completion(ChatCompletionRequest.model_validate(follow), raw_request)
        rounds += 1
    if not isinstance(result, ErrorResponse):
        choice = result.choices[0]
        calls = choice.message.tool_calls or []
        kept = [c for c in calls if c.function.name not in names]
        if len(kept) < len(calls):  # the client never sees calls of tools it did not send
            choice.message.tool_calls = kept
            if not kept and choice.finish_reason == "tool_calls":
                choice.finish_reason = "stop"
    return result, rounds


@router.get("/pamer/sessions/{session_id}")
async def session_info(session_id: str, raw_request: Request):
    server: PamerServer = raw_request.app.state.pamer
    state = server.sessions.get(session_id)
    loaded = await asyncio.to_thread(server.store.load, session_id)
    if state is None and not loaded.memories:
        return error_response(404, f"no session {session_id!r}", "NotFoundError")
    content = state.summary() if state is not None else {"session_id": session_id}
    content["memories"] = [m.public() for m in loaded.memories]
    content["events"] = await asyncio.to_thread(server.store.events, session_id)
    return JSONResponse(content=content)


class PamerEndpointPlugin:
    """``vllm.endpoint_plugins`` entry: routes above + state on app.state.pamer."""

    name = "pamer_endpoint"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        if engine_client is None:
            raise RuntimeError("vllm-pamer needs an engine (the render-only server is not supported)")
        server = PamerServer(PamerConfig.from_env(), engine_client, args)
        server.inbox.start()
        state.pamer = server
        logger.info(
            "vllm-pamer ready: policy=%s heads=%s channel=%s tools_as_text=%s",
            server.default_policy.name, server.config.heads, server.inbox.address, server.tools_as_text,
        )
