"""The ``pamer`` policy: it loads the session's memories and hands the
request to its schedule (``budget_schedule.py`` or ``paper_schedule.py``, by
the config's type), which decides and acts."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.policies.base import (
    HeadVote,
    MemoryPolicy,
    PolicyConfig,
    PolicyContext,
    PolicyDecision,
    PolicyRequest,
    register_policy,
)
from vllm_pamer.core.policies.pamer.ahead_schedule import AheadSchedule
from vllm_pamer.core.policies.pamer.budget_schedule import BudgetSchedule
from vllm_pamer.core.policies.pamer.config import BudgetConfig, PamerConfig, PaperConfig, schedule_config
from vllm_pamer.core.policies.pamer.memory import MemoryKind, MemoryWriter, with_turns
from vllm_pamer.core.policies.pamer.paper_schedule import PaperSchedule
from vllm_pamer.core.store import Memory, StoreError


class Schedule(Protocol):
    """What a PaMER schedule does with one request of a session."""

    async def rewrite(
        self, request: PolicyRequest, context: PolicyContext, memories: list[Memory], notes: list[str]
    ) -> PolicyDecision: ...

    async def on_vote(self, session_id: str, vote: HeadVote, context: PolicyContext) -> None: ...


@register_policy
class Pamer(MemoryPolicy):
    name = "pamer"
    config_cls: ClassVar[type[PolicyConfig]] = BudgetConfig
    """The default schedule's; ``make_config`` picks by ``schedule``."""
    requires_heads = True
    memory_kind: ClassVar[MemoryKind] = "summary"
    """What the budget schedule's compactions write (the baselines on its schedule write less)."""
    config: PamerConfig

    def __init__(self, config: PamerConfig | None = None) -> None:
        super().__init__(config)
        self.memory = MemoryWriter(self.config)
        self.schedule: Schedule = (
            PaperSchedule(self.config, self.memory)
            if isinstance(self.config, PaperConfig)
            else (AheadSchedule if self.config.write_ahead else BudgetSchedule)(
                self.config,
                self.memory,
                kind=with_turns(self.memory_kind, self.config.turns_share),
                expects_vote=self.requires_heads,
            )
        )

    @classmethod
    def config_classes(cls) -> tuple[type[PolicyConfig], ...]:
        return (BudgetConfig, PaperConfig)

    @classmethod
    def make_config(cls, options: dict[str, Any]) -> PolicyConfig:
        return schedule_config(options)

    async def on_vote(self, session_id: str, vote: HeadVote, context: PolicyContext) -> None:
        await self.schedule.on_vote(session_id, vote, context)

    def in_flight(self, session_id: str) -> dict[str, Any] | None:
        schedule = self.schedule
        if isinstance(schedule, BudgetSchedule) and schedule.later is not None:
            writing = schedule.later.pending(session_id)
            return {"summaries_after": writing} if writing else None
        if not isinstance(schedule, AheadSchedule) or (pending := schedule.ahead.pending(session_id)) is None:
            return None
        ended = pending.finished if pending.finished is not None else schedule.clock()
        seconds = round(ended - pending.started, 3)
        return {
            "blocks": len(pending.block_ids),
            "trigger": pending.trigger,
            "ready": pending.task.done(),
            "seconds": seconds,
        }

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        context = self.needs_context(request)
        try:
            loaded = await context.store.load(request.session_id)
        except StoreError as exc:
            return PolicyDecision.fallback(request.conversation.messages(), Fallback.STORAGE_FAILURE, str(exc))
        notes = [f"discarded {loaded.discarded} corrupt memories"] if loaded.discarded else []
        return await self.schedule.rewrite(request, context, loaded.memories, notes)
