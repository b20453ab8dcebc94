"""Summary baselines of the paper: Periodic Summary and Rolling Summary.

Both work on C_eff like PaMER (raw blocks covered by a stored memory of the
session are dropped) and keep the ``retained_blocks`` most recent live blocks
raw. Unlike PaMER they need no heads and never search: the trigger is a fixed
rule, and the memories they send are chosen by position, not by similarity.

* ``periodic_summary``: every time ``n`` old blocks have piled up, summarize
  them into a new memory; every request carries all of the session's memories.
* ``rolling_summary``: when the old blocks reach ``trigger_tokens``, write one
  new summary of (the previous summary + those blocks); a request carries only
  that newest summary, which supersedes the earlier ones.

Storage precedes removal: blocks leave the request only after the memory that
covers them was committed; any failure sends the original request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_pamer.core.blocks import Block, Message
from vllm_pamer.core.memory_store import Memory, StoreError
from vllm_pamer.core.policies.base import (
    MemoryPolicy,
    PolicyDecision,
    PolicyRequest,
    register_policy,
)
from vllm_pamer.core.policies.pamer import (
    PamerContext,
    SummaryConfig,
    cap_head_and_tail,
    memory_message,
    serialize_messages,
    step_details,
    with_retries,
)

NO_EMBEDDER = "none"
"""Embedder name of these memories: no embedder has it, so PaMER's recall
(which searches only memories of the current embedder) never searches them."""
NO_EMBEDDING = np.zeros(1, dtype=np.float32)
"""These policies never search, so they store a placeholder, not an embedding."""


class PeriodicSummaryConfig(SummaryConfig, frozen=True):
    n: int = 5
    """Summarize once this many old (live, not retained) blocks have piled up."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n < 1:
            raise ValueError("n must be >= 1")


class RollingSummaryConfig(SummaryConfig, frozen=True):
    trigger_tokens: int = 2048
    """Summarize once the old (live, not retained) blocks reach this many tokens."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.trigger_tokens < 1:
            raise ValueError("trigger_tokens must be >= 1")


def _flat(blocks: Sequence[Block]) -> list[Message]:
    return [m for b in blocks for m in b.messages]


class _SummaryPolicy(MemoryPolicy):
    """The shared transaction; subclasses choose when to summarize, what the
    source is, and which memories a request carries."""

    def _due(self, old: list[Block], memories: list[Memory], services) -> bool:
        raise NotImplementedError

    def _source(self, old: list[Block], memories: list[Memory]) -> str:
        return serialize_messages(_flat(old))

    def _shown(self, memories: list[Memory]) -> list[Memory]:
        raise NotImplementedError

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        context: PamerContext | None = request.memory
        if context is None:
            raise RuntimeError(f"{self.name} needs a memory store and engine services")
        cfg: SummaryConfig = self.config
        store, services = context.store, context.services
        session = request.session_id
        original = request.conversation.messages()

        def fail(rule: str, exc: Exception) -> PolicyDecision:
            store.log_event(session, rule, {"policy": self.name, "error": str(exc)})
            return PolicyDecision(original, f"fallback:{rule}", str(exc))

        try:
            memories = store.load(session).memories
        except StoreError as exc:
            return fail("storage_failure", exc)
        # C_eff: blocks a memory covers are not sent raw again.
        covered = {block_id for m in memories for block_id in m.covered_block_ids}
        live = [b for b in request.conversation.blocks if b.block_id not in covered]
        cut = max(0, len(live) - cfg.retained_blocks)
        old, recent = live[:cut], live[cut:]

        action, notes = "recalled", []
        if old and self._due(old, memories, services):
            source = cap_head_and_tail(self._source(old, memories), cfg.summary_source_chars)
            try:
                summary = await with_retries(
                    lambda: services.summarize(source, cfg.summary_max_tokens),
                    cfg.summary_timeout_s, cfg.summary_attempts, "summary",
                )
                if not isinstance(summary, str) or not summary.strip():
                    raise RuntimeError("the summary came back empty")
            except Exception as exc:
                return fail("summary_failure", exc)
            archived = list({b.block_id: b for b in old}.values())  # a repeated block is stored once
            try:
                memory_id = store.commit_memory(
                    session, summary.strip(), NO_EMBEDDING, NO_EMBEDDER, archived, step_details(archived)
                )
                memories = store.load(session).memories
            except Exception as exc:  # storage precedes removal: nothing is removed
                return fail("storage_failure", exc)
            store.log_event(session, "compressed", {"policy": self.name, "memory_id": memory_id, "blocks": len(old)})
            live, action = recent, "compressed"
            notes.append(f"archived {len(old)} blocks as memory {memory_id}")

        if not memories:  # nothing covered: C_eff is the request itself
            return PolicyDecision(original, "none")
        shown = self._shown(memories)
        inserted = [memory_message(shown)]
        notes.append(f"sent memories {[m.id for m in shown]}")
        messages = list(request.conversation.prefix) + inserted + _flat(live)
        return PolicyDecision(messages, action, "; ".join(notes), services.count_tokens(inserted))


@register_policy
class PeriodicSummary(_SummaryPolicy):
    """``periodic_summary``: summarize every ``n`` old blocks into a memory; send
    all the session's memories (oldest first) as one message after the prefix."""

    name = "periodic_summary"
    config_cls = PeriodicSummaryConfig

    def _due(self, old: list[Block], memories: list[Memory], services) -> bool:
        return len(old) >= self.config.n

    def _shown(self, memories: list[Memory]) -> list[Memory]:
        return memories


@register_policy
class RollingSummary(_SummaryPolicy):
    """``rolling_summary``: when the old blocks reach ``trigger_tokens``, fold
    them and the previous summary into one new summary; send only the newest."""

    name = "rolling_summary"
    config_cls = RollingSummaryConfig

    def _due(self, old: list[Block], memories: list[Memory], services) -> bool:
        return services.count_tokens(_flat(old)) >= self.config.trigger_tokens

    def _source(self, old: list[Block], memories: list[Memory]) -> str:
        steps = super()._source(old, memories)
        if not memories:
            return steps
        # The newest summary already folds in every earlier one.
        return f"summary of the steps before these: {memories[-1].summary}\n{steps}"

    def _shown(self, memories: list[Memory]) -> list[Memory]:
        return memories[-1:]
