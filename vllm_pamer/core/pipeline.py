"""The rewrite path of one request, with the fallback rules (``core/fallback.py``).

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
from vllm_pamer.core.fallback import Fallback, fallback_rule
from vllm_pamer.core.policies import (
    HeadVote,
    MemoryPolicy,
    PolicyContext,
    PolicyDecision,
    PolicyRequest,
    ScheduleReport,
)
from vllm_pamer.core.recall import WorkerRecall

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
        return fallback_rule(self.action) is not None


def _fallback(messages: Sequence[Message], rule: Fallback, detail: str = "") -> RewriteOutcome:
    return RewriteOutcome(list(messages), rule.action, detail)


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
        return _fallback(messages, Fallback.MISSING_SESSION_ID)
    issues = protocol_issues(messages)
    if issues:
        first = issues[0]
        return _fallback(
            messages, Fallback.UNSAFE_TOOL_PROTOCOL, f"{first.rule} at message {first.index}: {first.detail}"
        )
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
        return _fallback(messages, Fallback.POLICY_ERROR, f"{type(exc).__name__}: {exc}")
    if decision.fallback_rule is not None:
        return RewriteOutcome(list(messages), decision.action, decision.detail, schedule=decision.schedule)
    issues = protocol_issues(decision.messages)
    if issues or not decision.messages:
        return _fallback(messages, Fallback.INVALID_REWRITE, issues[0].detail if issues else "empty result")
    return RewriteOutcome(
        decision.messages,
        decision.action,
        decision.detail,
        decision.tokens_inserted,
        decision.extra_tools,
        decision.recalled,
        decision.schedule,
    )
