"""Baseline policies that need no heads."""

from __future__ import annotations

import msgspec

from vllm_pamer.core.policies.base import (
    MemoryPolicy,
    PolicyConfig,
    PolicyDecision,
    PolicyRequest,
    register_policy,
)


@register_policy
class PassThrough(MemoryPolicy):
    """``none``: send every request as the agent wrote it (capture still runs)."""

    name = "none"

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        return PolicyDecision(request.conversation.messages(), "none")


class RecentKConfig(PolicyConfig, frozen=True):
    k: int = msgspec.field(default=2)
    """Number of most recent blocks kept after the prefix."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("recent_k needs k >= 1")


@register_policy
class RecentK(MemoryPolicy):
    """``recent_k``: keep the prefix and the last k blocks, drop the rest."""

    name = "recent_k"
    config_cls = RecentKConfig

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        conversation = request.conversation
        old, recent = conversation.old_and_recent(self.config.k)
        if not old:
            return PolicyDecision(conversation.messages(), "none")
        kept = list(conversation.prefix) + [m for block in recent for m in block.messages]
        return PolicyDecision(kept, "rewritten", f"dropped {len(old)} old blocks")
