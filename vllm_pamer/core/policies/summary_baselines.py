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

from vllm_pamer.core.blocks import Block
from vllm_pamer.core.engine import EngineServices
from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.policies.base import MemoryPolicy, PolicyDecision, PolicyRequest, register_policy
from vllm_pamer.core.policies.summary_writer import (
    StepFailure,
    SummaryConfig,
    memory_message,
    step_details,
    write_summary,
)
from vllm_pamer.core.store import NO_EMBEDDING, Memory, StoreError
from vllm_pamer.core.text import serialize_messages
from vllm_pamer.core.view import context_view, flatten

NO_EMBEDDER = "none"
"""Embedder name of these memories: no embedder has it, so PaMER's recall
(which searches only memories of the current embedder) never searches them."""


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


class _SummaryPolicy(MemoryPolicy):
    """The shared transaction; subclasses choose when to summarize, what the
    source is, and which memories a request carries."""

    config: SummaryConfig

    def _due(self, old: list[Block], memories: list[Memory], services: EngineServices) -> bool:
        raise NotImplementedError

    def _source(self, old: list[Block], memories: list[Memory]) -> str:
        return serialize_messages(flatten(old))

    def _shown(self, memories: list[Memory]) -> list[Memory]:
        raise NotImplementedError

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        context = self.needs_context(request)
        cfg = self.config
        store, services = context.store, context.services
        session = request.session_id
        original = request.conversation.messages()

        async def fail(rule: Fallback, exc: Exception) -> PolicyDecision:
            await store.log_event(session, rule.value, {"policy": self.name, "error": str(exc)})
            return PolicyDecision.fallback(original, rule, str(exc))

        try:
            memories = (await store.load(session)).memories
        except StoreError as exc:
            return await fail(Fallback.STORAGE_FAILURE, exc)
        view = context_view(request.conversation, memories, cfg.retained_blocks)
        old, live = list(view.old), list(view.live)

        action, notes = "recalled", []
        if old and self._due(old, memories, services):
            try:
                summary = await write_summary(services, cfg, old, source=self._source(old, memories))
            except StepFailure as failure:
                return await fail(failure.rule, failure)
            archived = list({b.block_id: b for b in old}.values())  # ids are unique (core/blocks.py); kept as a guard
            try:
                memory_id = await store.commit_memory(
                    session, summary, NO_EMBEDDING, NO_EMBEDDER, archived, step_details(archived)
                )
                memories = (await store.load(session)).memories
            except Exception as exc:  # storage precedes removal: nothing is removed
                return await fail(Fallback.STORAGE_FAILURE, exc)
            await store.log_event(
                session, "compressed", {"policy": self.name, "memory_id": memory_id, "blocks": len(old)}
            )
            live, action = list(view.recent), "compressed"
            notes.append(f"archived {len(old)} blocks as memory {memory_id}")

        if not memories:  # nothing covered: C_eff is the request itself
            return PolicyDecision(original, "none")
        shown = self._shown(memories)
        inserted = [memory_message(shown)]
        notes.append(f"sent memories {[m.id for m in shown]}")
        messages = list(view.prefix) + inserted + flatten(live)
        return PolicyDecision(messages, action, "; ".join(notes), services.count_tokens(inserted))


@register_policy
class PeriodicSummary(_SummaryPolicy):
    """``periodic_summary``: summarize every ``n`` old blocks into a memory; send
    all the session's memories (oldest first) as one message after the prefix."""

    name = "periodic_summary"
    config_cls = PeriodicSummaryConfig
    config: PeriodicSummaryConfig

    def _due(self, old: list[Block], memories: list[Memory], services: EngineServices) -> bool:
        return len(old) >= self.config.n

    def _shown(self, memories: list[Memory]) -> list[Memory]:
        return memories


@register_policy
class RollingSummary(_SummaryPolicy):
    """``rolling_summary``: when the old blocks reach ``trigger_tokens``, fold
    them and the previous summary into one new summary; send only the newest."""

    name = "rolling_summary"
    config_cls = RollingSummaryConfig
    config: RollingSummaryConfig

    def _due(self, old: list[Block], memories: list[Memory], services: EngineServices) -> bool:
        return services.count_tokens(flatten(old)) >= self.config.trigger_tokens

    def _source(self, old: list[Block], memories: list[Memory]) -> str:
        steps = super()._source(old, memories)
        if not memories:
            return steps
        # The newest summary already folds in every earlier one.
        return f"summary of the steps before these: {memories[-1].summary}\n{steps}"

    def _shown(self, memories: list[Memory]) -> list[Memory]:
        return memories[-1:]
