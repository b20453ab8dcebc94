"""The budget schedule with memories written ahead of need
(``BudgetConfig.write_ahead``; the memories in flight: ``ahead.py``). The
decision is the budget schedule's (``decide``); the action differs: a
compaction called for while the request fits the window starts the memory
in the background and sends the request as it is; the session's first
request after the memory is ready compacts with it. Only a request the
window cannot hold waits; if archiving the memory's blocks would still not
fit it, or the memory failed, that request compacts inline. A memory whose
blocks are no longer the oldest live ones is abandoned (an event says why)."""

from __future__ import annotations

from functools import cached_property

import msgspec

from vllm_pamer.core.policies.base import PolicyContext, PolicyDecision, PolicyRequest
from vllm_pamer.core.policies.pamer.ahead import AheadWrites
from vllm_pamer.core.policies.pamer.budget import Choice, chars_per_token
from vllm_pamer.core.policies.pamer.budget_schedule import BudgetSchedule


class AheadSchedule(BudgetSchedule):
    @cached_property
    def ahead(self) -> AheadWrites:
        """The session's memories in flight."""
        return AheadWrites(lambda: self.clock())

    async def act(
        self, request: PolicyRequest, context: PolicyContext, choice: Choice, notes: list[str]
    ) -> PolicyDecision:
        writes, session, live = self.ahead, request.session_id, list(choice.view.live)
        pending = writes.pending(session)
        if pending is not None and (pending.task.cancelled() or not pending.covers([b.block_id for b in live])):
            # another process archived its blocks, the history was edited, or its event loop ended
            await self.abandon(session, context, "its blocks are no longer the oldest live ones")
            pending = None
        if pending is not None and (pending.task.done() or choice.trigger == "window"):
            writes.take(session)
            plan = choice.plan if choice.plan is not None else self.plan(choice.view, choice.budget, context.services)
            plan = msgspec.structs.replace(plan, count=len(pending.block_ids))
            return await self.compact(request, context, choice, plan, pending.trigger, notes, pending)
        if choice.trigger is None or choice.plan is None:
            return self.send(request, context, choice, notes)
        if choice.trigger == "window":  # the one request that waits for its memory
            return await self.compact(request, context, choice, choice.plan, choice.trigger, notes)
        if pending is None:
            archived, kept = live[: choice.plan.count], live[choice.plan.count :]
            record_chars = int(choice.plan.record_tokens * chars_per_token(archived, choice.plan))
            work = self.written.write(request, context, choice, archived, kept, record_chars)
            # tracked before the first await, so the session's next request finds it
            pending = writes.start(session, [b.block_id for b in archived], choice.trigger, work)
            detail = {"blocks": len(archived), "sent_tokens": choice.report.sent_tokens, "trigger": choice.trigger}
            await context.store.log_event(session, "compression_started", {**detail, "ahead": True})
        notes.append(f"{choice.trigger}: a memory of {len(pending.block_ids)} blocks is written ahead; sent as is")
        return self.send(request, context, choice, notes)

    async def abandon(self, session: str, context: PolicyContext, reason: str) -> None:
        """Drops the session's memory in flight (nothing of it was stored)."""
        pending = self.ahead.take(session)
        if pending is not None:
            pending.task.cancel()
            detail = {"blocks": len(pending.block_ids), "reason": reason}
            await context.store.log_event(session, "compression_abandoned", detail)
