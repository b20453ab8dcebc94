"""The rewrite path of one request, with the paper's fallback rules.

Pure: takes messages and the session's previous vote, returns what to send
and the action taken. A rule that fires always returns the original messages,
so nothing the agent sent is ever lost.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec
import numpy as np

from vllm_pamer.core.blocks import Message, Tool, protocol_issues, split_conversation
from vllm_pamer.core.policies import HeadVote, MemoryPolicy, PolicyContext, PolicyDecision, PolicyRequest
from vllm_pamer.core.recall import WorkerRecall
from vllm_pamer.core.schedule import ScheduleReport

logger = logging.getLogger("vllm_pamer.pipeline")


class RewriteOutcome(msgspec.Struct, frozen=True):
    messages: list[Message]
    action: str
    """``none``, ``rewritten`` or ``fallback:<rule>``."""
    detail: str = ""
    tokens_inserted: int = 0
    extra_tools: tuple[Tool, ...] = ()
    recalled: tuple[int, ...] | None = None
    schedule: ScheduleReport | None = None

    @property
    def is_fallback(self) -> bool:
        return self.action.startswith("fallback:")


def _fallback(messages: Sequence[Message], rule: str, detail: str = "") -> RewriteOutcome:
    return RewriteOutcome(list(messages), f"fallback:{rule}", detail)


async def rewrite_request(
    messages: Sequence[Message],
    session_id: str | None,
    policy: MemoryPolicy,
    previous_vote: HeadVote | None = None,
    context: PolicyContext | None = None,
    previous_state: np.ndarray | None = None,
    tools: list[Tool] | None = None,
    prompt_tokens: int | None = None,
    context_budget: int | None = None,
    answer_tokens: int | None = None,
    previous_recall: WorkerRecall | None = None,
) -> RewriteOutcome:
    if not session_id:
        return _fallback(messages, "missing_session_id")
    issues = protocol_issues(messages)
    if issues:
        first = issues[0]
        return _fallback(messages, "unsafe_tool_protocol", f"{first.rule} at message {first.index}: {first.detail}")
    request = PolicyRequest(
        session_id,
        split_conversation(messages),
        previous_vote,
        context,
        previous_state,
        tools,
        prompt_tokens,
        context_budget,
        answer_tokens,
        previous_recall,
    )
    try:
        decision: PolicyDecision = await policy.rewrite(request)
    except Exception as exc:  # a failed memory operation never removes history
        logger.exception("policy %s failed", policy.name)
        return _fallback(messages, "policy_error", f"{type(exc).__name__}: {exc}")
    if decision.action.startswith("fallback:"):
        return RewriteOutcome(list(messages), decision.action, decision.detail, schedule=decision.schedule)
    issues = protocol_issues(decision.messages)
    if issues or not decision.messages:
        return _fallback(messages, "invalid_rewrite", issues[0].detail if issues else "empty result")
    return RewriteOutcome(
        decision.messages,
        decision.action,
        decision.detail,
        decision.tokens_inserted,
        decision.extra_tools,
        decision.recalled,
        decision.schedule,
    )
