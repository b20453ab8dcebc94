"""The rewrite path of one request, with the fallback rules (``core/fallback.py``).

Pure: takes the one typed request (``PolicyRequest``) and a policy, returns
the one typed outcome (``PolicyDecision``: what to send and the action
taken). A rule that fires always returns the original messages, so nothing
the agent sent is ever lost.
"""

from __future__ import annotations

import logging

from vllm_pamer.core.blocks import protocol_issues
from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.policies import MemoryPolicy, PolicyDecision, PolicyRequest

logger = logging.getLogger("vllm_pamer.pipeline")


def _fallback(request: PolicyRequest, rule: Fallback, detail: str = "") -> PolicyDecision:
    return PolicyDecision.fallback(list(request.messages), rule, detail)


async def rewrite_request(policy: MemoryPolicy, request: PolicyRequest) -> PolicyDecision:
    """What to send for ``request``: ``policy``'s decision, or the original
    messages by the first fallback rule that fires."""
    if not request.session_id:
        return _fallback(request, Fallback.MISSING_SESSION_ID)
    issues = protocol_issues(request.messages)
    if issues:
        first = issues[0]
        return _fallback(
            request, Fallback.UNSAFE_TOOL_PROTOCOL, f"{first.rule} at message {first.index}: {first.detail}"
        )
    try:
        decision: PolicyDecision = await policy.rewrite(request)
    except Exception as exc:  # a failed memory operation never removes history
        logger.exception("policy %s failed", policy.name)
        return _fallback(request, Fallback.POLICY_ERROR, f"{type(exc).__name__}: {exc}")
    if decision.fallback_rule is not None:  # the policy's own rule: the original messages, its report kept
        return PolicyDecision.fallback(
            list(request.messages), decision.fallback_rule, decision.detail, decision.schedule
        )
    issues = protocol_issues(decision.messages)
    if issues or not decision.messages:
        return _fallback(request, Fallback.INVALID_REWRITE, issues[0].detail if issues else "empty result")
    return decision
