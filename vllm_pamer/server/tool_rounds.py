"""The policy's own tools (SAM's ``memory``): which requests get them, and
the rounds the server answers itself before the client sees the answer."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import Request

from vllm_pamer.adapters.serving import is_error, validate_chat_request
from vllm_pamer.channel import SESSION_KEY
from vllm_pamer.core.blocks import Message
from vllm_pamer.core.policies import MemoryPolicy
from vllm_pamer.server import metrics

if TYPE_CHECKING:
    from vllm_pamer.server.output import PamerReport
    from vllm_pamer.server.state import ServerState

logger = logging.getLogger("vllm_pamer.tool_rounds")

MAX_OWN_TOOL_ROUNDS = 3  # memory-tool calls answered per request before the answer goes back


def offered_tools(
    extra_tools: tuple[dict, ...],
    body: dict[str, Any],
    client_tools: list[Any],
    report: PamerReport,
    auto_tools: bool,
) -> list[dict]:
    """The policy's own tools to add to this request: non-streaming only (the
    server must read the whole answer to resolve a call), not when the client
    turned tools off or already has a tool of that name, and, when the client
    leaves the choice to the model, only if the server parses tool calls
    (``--enable-auto-tool-choice``; vLLM refuses "auto" otherwise)."""
    if not extra_tools or body.get("stream") or body.get("tool_choice") == "none":
        return []
    if body.get("tool_choice") in (None, "auto") and not auto_tools:
        report.note("memory tool not offered: the server runs without --enable-auto-tool-choice")
        return []
    taken = {t.get("function", {}).get("name") for t in client_tools if isinstance(t, dict)}
    clashes = [t["function"]["name"] for t in extra_tools if t["function"]["name"] in taken]
    if clashes:
        report.note(f"tool {clashes} not offered: the client has a tool of that name")
    return [dict(t) for t in extra_tools if t["function"]["name"] not in taken]


async def resolve_own_tool_calls(
    state: ServerState,
    policy: MemoryPolicy,
    session_id: str | None,
    body: dict[str, Any],
    messages: list[Message],
    result: Any,
    raw_request: Request,
    names: set[str],
    xargs: dict[str, Any],
) -> tuple[Any, int]:
    """Answer the model's calls of the policy's own tools and continue the
    generation, up to MAX_OWN_TOOL_ROUNDS; the client gets the final answer
    with only its own tool calls. Returns (result, rounds)."""
    handler = raw_request.app.state.openai_serving_chat
    rounds = 0
    while not is_error(result):
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
                content = await policy.resolve_tool_call(
                    session_id or "", call.function.name, call.function.arguments, state.context
                )
            except Exception as exc:  # the model reads the error; nothing of the request is lost
                logger.exception("policy %s failed to resolve %s", policy.name, call.function.name)
                content = f"{call.function.name} error: {type(exc).__name__}"
            answers.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": content})
        assistant = {"role": "assistant", "content": message.content, "tool_calls": [c.model_dump() for c in ours]}
        messages = list(messages) + [assistant] + answers
        follow = {**body, "messages": state.render(messages), "vllm_xargs": {**xargs, SESSION_KEY: ""}}
        if isinstance(body.get("tool_choice"), dict):  # a forced call of our tool is answered once
            follow["tool_choice"] = "none"
        result = await handler.create_chat_completion(validate_chat_request(follow), raw_request)
        rounds += 1
    if not is_error(result):
        choice = result.choices[0]
        calls = choice.message.tool_calls or []
        kept = [c for c in calls if c.function.name not in names]
        if len(kept) < len(calls):  # the client never sees calls of tools it did not send
            choice.message.tool_calls = kept
            if not kept and choice.finish_reason == "tool_calls":
                choice.finish_reason = "stop"
    return result, rounds
