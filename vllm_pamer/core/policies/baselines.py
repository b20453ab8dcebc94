"""Baseline policies that need no heads and no engine services.

* ``none`` - the request as the agent wrote it;
* ``recent_k`` / ``sliding_window`` - the prefix and the last K blocks;
* ``discard_tool`` - every message, but old tool outputs replaced by a stub.

The summary baselines (``periodic_summary``, ``rolling_summary``) live in
``summary_baselines.py``: they need a memory store and engine services.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm_pamer.core.blocks import Message
from vllm_pamer.core.policies.base import (
    MemoryPolicy,
    PolicyConfig,
    PolicyDecision,
    PolicyRequest,
    register_policy,
)
from vllm_pamer.core.view import context_view, flatten

TOOL_ROLES = frozenset({"tool", "function"})


@register_policy
class PassThrough(MemoryPolicy):
    """``none``: send every request as the agent wrote it (capture still runs)."""

    name = "none"
    counts_prompt = False

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        return PolicyDecision(request.conversation.messages(), "none")


class RecentKConfig(PolicyConfig, frozen=True):
    k: int = 2
    """Number of most recent blocks kept after the prefix (the paper's Recent2)."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("k must be >= 1")


class SlidingWindowConfig(RecentKConfig, frozen=True):
    k: int = 10
    """Number of most recent blocks kept after the prefix (paper: K = 5, 10, 20)."""


class _LastBlocks(MemoryPolicy):
    """Keep the prefix and the last ``config.k`` blocks, drop the rest.
    Whole blocks only, so every tool call stays next to its results."""

    config: RecentKConfig

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        view = context_view(request.conversation, retained_blocks=self.config.k)
        if not view.old:
            return PolicyDecision(request.conversation.messages(), "none")
        return PolicyDecision(view.messages(old=False), "rewritten", f"dropped {len(view.old)} old blocks")


@register_policy
class RecentK(_LastBlocks):
    """``recent_k``: the sliding-window rule with the paper's Recent2 default (k=2)."""

    name = "recent_k"
    config_cls = RecentKConfig


@register_policy
class SlidingWindow(_LastBlocks):
    """``sliding_window``: the paper's Sliding Window baseline (prefix + last K
    blocks, default K=10). Same rule as ``recent_k``, which defaults to k=2."""

    name = "sliding_window"
    config_cls = SlidingWindowConfig


class DiscardToolConfig(PolicyConfig, frozen=True):
    window: int = 2
    """Tool outputs of the last ``window`` blocks are kept; older ones are stubbed."""

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError("window must be >= 0")


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0


def tool_placeholder(chars: int) -> str:
    return f"[tool output removed: {chars} chars]"


def masked(messages: Iterable[Message]) -> tuple[list[Message], int]:
    """``messages`` with every tool output replaced by its placeholder (the
    result message stays, so each call is still answered), and how many were
    replaced. The input is never mutated."""
    out: list[Message] = []
    stubbed = 0
    for message in messages:
        chars = _content_chars(message.get("content"))
        if message.get("role") in TOOL_ROLES and chars:
            message = {**message, "content": tool_placeholder(chars)}
            stubbed += 1
        out.append(message)
    return out, stubbed


@register_policy
class DiscardTool(MemoryPolicy):
    """``discard_tool``: keep every message, but replace the output of tool
    results older than the last ``window`` blocks by a short placeholder.

    Tool outputs are usually the bulk of an agent's context, while its own
    actions are short; the result message itself stays (with ``tool_call_id``
    and ``name``) so every call is still answered and the protocol stays valid.
    """

    name = "discard_tool"
    config_cls = DiscardToolConfig
    config: DiscardToolConfig

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        conversation = request.conversation
        view = context_view(conversation, retained_blocks=self.config.window)
        old, stubbed = masked(flatten(view.old))
        out = list(view.prefix) + old + flatten(view.recent)
        if not stubbed:
            return PolicyDecision(conversation.messages(), "none")
        return PolicyDecision(out, "rewritten", f"removed {stubbed} old tool outputs")
