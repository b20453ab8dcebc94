"""PaMER's budget schedule (``schedule="budget"``): compactions that keep
vLLM's prefix cache.

Per request of a session, with C_eff = P + the live blocks:

1. the memories shown are the ones chosen at the session's last compaction,
   so the memory text E after the prefix stays the same between compactions
   and what is sent, P + E + live blocks, only grows at its end;
2. the request's size is the server's count of it as received minus a fixed
   offset (what C_eff removes, less E), worked out once per compaction, so no
   request between compactions is counted again;
3. ``decide`` says whether to compact now (the numbers: ``budget.py``);
4. ``compact`` archives the oldest live blocks down to the target: a memory
   (``compaction_memory.py``; PaMER's: a summary of them plus a verbatim
   record, ``record.py``, of every step the session archived so far, so
   exact values of early steps carry over), stored with the raw blocks in
   one transaction before they leave the request; then it
   chooses the memories to show until the next compaction: the new one
   whole, and the summaries of older ones closest to the captured state,
   within the memory budget. Otherwise ``send`` sends P + E + live blocks.

Any failure sends the original request; nothing is removed before it is stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
from cachetools import LRUCache, TTLCache

from vllm_pamer.core.blocks import Message
from vllm_pamer.core.engine import EngineServices
from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.policies.base import (
    MAX_TRACKED_SESSIONS,
    HeadVote,
    PolicyContext,
    PolicyDecision,
    PolicyRequest,
    ScheduleReport,
    Trigger,
)
from vllm_pamer.core.policies.pamer.ahead import Ahead
from vllm_pamer.core.policies.pamer.budget import (
    CHARS_PER_TOKEN,
    Budget,
    Choice,
    Offset,
    Plan,
    answer_room,
    archive_count,
    band_vote,
    budget_for,
    chars_per_token,
    kv_share_tokens,
    trigger,
)
from vllm_pamer.core.policies.pamer.compaction_end import ends_with_an_event
from vllm_pamer.core.policies.pamer.compaction_memory import CompactionMemory
from vllm_pamer.core.policies.pamer.config import BudgetConfig
from vllm_pamer.core.policies.pamer.control_vote import control_says, load_control_trigger
from vllm_pamer.core.policies.pamer.memory import (
    MASKED_KINDS,
    SUMMARY_KINDS,
    TURN_KINDS,
    MemoryKind,
    MemoryWriter,
    captured_query,
    kind_embedder,
    shown_messages,
)
from vllm_pamer.core.policies.pamer.shown import ShownMemories
from vllm_pamer.core.policies.pamer.summary_after import SummariesAfter
from vllm_pamer.core.policies.summary_writer import StepFailure, step_details
from vllm_pamer.core.store import Memory, StoreError
from vllm_pamer.core.view import ContextView, context_view, flatten

WINDOW_SLACK = 64
"""Tokens from the window within which a request's size is counted, not
estimated from the count as received (``_sent_tokens``): the estimate can
be a few tokens short, and there a few tokens decide whether vLLM refuses it
(``benchmarks/RESULTS.md``, "Every mini-swe trajectory at the tight budget")."""


class BudgetSchedule:
    def __init__(
        self,
        config: BudgetConfig,
        memory: MemoryWriter,
        clock: Callable[[], float] = time.monotonic,
        kind: MemoryKind = "summary",
        expects_vote: bool = True,
    ) -> None:
        self.config = config
        self.memory = memory
        self.kind = kind
        """What replaces the archived blocks (``memory.MemoryKind``): PaMER's summary and record, or a baseline's."""
        self.expects_vote = expects_vote
        """A missing vote is a probe failure (logged); False for a policy that runs without heads."""
        self.clock = clock
        """Seconds, for the sessions' activity (a model of the server sets its own)."""
        # sessions with a request in the last kv_share_idle_s: those sharing the KV cache
        self._active: TTLCache[str, bool] = TTLCache(
            MAX_TRACKED_SESSIONS, config.kv_share_idle_s, timer=lambda: self.clock()
        )
        self.control = load_control_trigger(config.control_trigger or None) if config.band_vote == "control" else None
        """``band_vote: control``'s model, read at start so a bad file fails the server's start."""
        after = config.summaries_after and kind in SUMMARY_KINDS
        self.later = SummariesAfter(memory, clock) if after else None
        """The summaries written after their compaction (``summary_after``); None: inline."""
        self.shown = ShownMemories(kind, config.top_k, newest_whole=self.later is None)
        self.written = CompactionMemory(config, memory, kind, self._count)
        self._offset: LRUCache[str, Offset] = LRUCache(MAX_TRACKED_SESSIONS)
        self._tokens: LRUCache[str, int] = LRUCache(10 * MAX_TRACKED_SESSIONS)  # by block id / text

    async def on_vote(self, session_id: str, vote: HeadVote, context: PolicyContext) -> None:
        """The vote is read at the session's next request (``decide``)."""

    async def rewrite(
        self, request: PolicyRequest, context: PolicyContext, memories: list[Memory], notes: list[str]
    ) -> PolicyDecision:
        """Decide, then compact or send append-only. A store read that fails
        sends the original request (``storage_failure``)."""
        try:
            choice = await self.decide(request, context, memories, notes)
        except StoreError as exc:
            await context.store.log_event(request.session_id, Fallback.STORAGE_FAILURE.value, {"error": str(exc)})
            return PolicyDecision.fallback(request.conversation.messages(), Fallback.STORAGE_FAILURE, str(exc))
        return await self.act(request, context, choice, notes)

    async def act(
        self, request: PolicyRequest, context: PolicyContext, choice: Choice, notes: list[str]
    ) -> PolicyDecision:
        """Compact now if the decision says so, else send append-only
        (``ahead_schedule.py`` acts otherwise under ``write_ahead``)."""
        if choice.trigger is not None and choice.plan is not None:
            return await self.compact(request, context, choice, choice.plan, choice.trigger, notes)
        return self.send(request, context, choice, notes)

    def _history_share(self) -> float:
        """The share of the budget the memories shown take: ``memory_share``,
        and beside it the excerpts' ``record_share`` or the newest memory's
        ``turns_share`` (they have their own room in ``plan``)."""
        cfg = self.config
        if self.kind == "excerpts":
            return cfg.memory_share + cfg.record_share
        return cfg.memory_share + (cfg.turns_share if self.kind in TURN_KINDS else 0.0)

    def _shown_messages(self, memories: list[Memory]) -> list[Message]:
        return shown_messages(self.kind, memories, newest_whole=self.later is None)

    def _count(self, key: str, messages: list[Message], services: EngineServices) -> int:
        if key not in self._tokens:
            self._tokens[key] = services.count_tokens(messages)
        return self._tokens[key]

    def _masked_size(self, services: EngineServices) -> Callable[[Memory], int]:
        """A masked memory's tokens, counted once per text."""
        return lambda m: self._count("masked:" + str(hash(m.summary)), shown_messages("masked", [m]), services)

    def _sent_tokens(
        self,
        request: PolicyRequest,
        view: ContextView,
        shown: tuple[int, ...],
        sent: list[Message],
        services: EngineServices,
        near: int | None,
    ) -> int:
        """The tokens of ``sent``: estimated from the count as received where it can be, else
        counted; counted too once an estimate reaches ``near`` (``WINDOW_SLACK``; None: no window)."""
        received = request.prompt_tokens
        estimate = None
        offset = self._offset.get(request.session_id)
        if received is not None and not view.covered and not shown:
            estimate = received  # C_eff is the request itself
        elif received is not None and offset is not None and (offset.covered, offset.shown) == (view.covered, shown):
            estimate = received - offset.tokens
        if estimate is not None and (near is None or estimate < near):
            return estimate
        tokens = services.prompt_tokens(sent, request.tools)
        if received is not None and estimate is None:
            self._offset[request.session_id] = Offset(view.covered, shown, received - tokens)
        return tokens

    async def decide(
        self, request: PolicyRequest, context: PolicyContext, memories: list[Memory], notes: list[str]
    ) -> Choice:
        """What the request sends without a compaction, and whether it compacts."""
        cfg = self.config
        store, services, session = context.store, context.services, request.session_id
        view = context_view(request.conversation, memories, cfg.retained_blocks)
        if view.covered:
            notes.append(f"{view.covered} blocks already in memory")
        kv = services.kv_usage()
        self._active[session] = True
        share = kv_share_tokens(cfg, services.kv_capacity() if cfg.kv_share else None, len(self._active))
        budget = budget_for(cfg, services.max_model_len, request.context_budget, kv, share)
        # Memories of another embedder still cover their blocks but are not shown.
        searchable = [m for m in memories if m.embedder == kind_embedder(self.kind, services)]
        if self.kind == "none":
            searchable = []  # truncation shows nothing
        if self.kind in MASKED_KINDS:  # a masked history is measured in tokens, the budget's own unit
            shown_ids = await self.shown.ids(
                session, searchable, store, int(self._history_share() * budget.budget), self._masked_size(services)
            )
        else:
            memory_chars = int(cfg.memory_share * budget.budget * CHARS_PER_TOKEN)
            shown_ids = await self.shown.ids(session, searchable, store, memory_chars)
        by_id = {m.id: m for m in searchable}
        shown = [by_id[i] for i in shown_ids]
        sent = list(view.prefix) + self._shown_messages(shown) + flatten(view.live)
        window = services.max_model_len
        answer = answer_room(request.answer_tokens, window) if window else 0
        near = window - answer - WINDOW_SLACK if window else None
        sent_tokens = self._sent_tokens(request, view, shown_ids, sent, services, near)
        fits = not window or sent_tokens + answer < window
        control = None
        if self.control is not None and sent_tokens >= budget.band_low:  # read only where it can decide
            control = await control_says(self.control, request, store, notes)
        vote = band_vote(cfg, request.previous_vote, session, view.covered + len(view.live), control)
        why = trigger(budget, sent_tokens, fits, vote)
        plan = self.plan(view, budget, services) if why is not None else None
        if plan is not None and why != "window" and plan.archived_tokens < budget.budget - budget.band_low:
            # compact in large steps only (at least a band's worth goes): a small one would
            # recompute the cache for little; only the window forces one
            notes.append(f"{why}: too little old history for a large step, no compaction")
            why = None
        report = ScheduleReport(
            budget.budget,
            budget.band_low,
            budget.target,
            sent_tokens,
            kv_usage=kv,
            kv_share=budget.budget if budget.shared else None,
        )
        heads_vote = self.expects_vote and cfg.band_vote == "heads"
        if why is None and vote is None and sent_tokens >= budget.band_low and heads_vote:
            notes.append("no vote captured (probe failure): no compaction inside the band")
            await store.log_event(session, "probe_missing", {"sent_tokens": sent_tokens})
        if plan is None or len(view.live) <= (1 if why == "window" else cfg.retained_blocks):
            why = None  # nothing old enough to archive (the window's guard may take R's older blocks)
        return Choice(view, budget, searchable, shown, sent, report, why, plan if why is not None else None)

    def plan(self, view: ContextView, budget: Budget, services: EngineServices) -> Plan:
        """Which blocks a compaction now would archive: the oldest, until the
        prefix, the new memory (its summary and its record's share of the
        budget) and the blocks left reach the target; R stays raw unless it alone keeps the
        request from its target, then only the newest block does."""
        cfg = self.config
        prefix = list(view.prefix)
        prefix_tokens = self._count("prefix:" + str(hash(str(prefix))), prefix, services)
        block_tokens = [self._count(b.block_id, list(b.messages), services) for b in view.live]
        # The record has its room before any raw block is kept: a line of many
        # archived steps carries more of what comes next than one more old block.
        record_tokens, masked_tokens = self.written.rooms(budget)
        summary_tokens = cfg.summary_max_tokens if self.kind in SUMMARY_KINDS and self.later is None else 0
        least = prefix_tokens + summary_tokens + record_tokens + masked_tokens
        count = archive_count(block_tokens, least, budget.target, cfg.retained_blocks)
        if least + sum(block_tokens[count:]) > budget.target:
            count = archive_count(block_tokens, least, budget.target, 1)
        return Plan(count, prefix_tokens, block_tokens, record_tokens)

    def send(self, request: PolicyRequest, context: PolicyContext, choice: Choice, notes: list[str]) -> PolicyDecision:
        """No compaction: P + the memories shown + the live blocks, append-only."""
        if not choice.view.covered and not choice.shown:
            return PolicyDecision(request.conversation.messages(), "none", "; ".join(notes), schedule=choice.report)
        shown_ids = tuple(m.id for m in choice.shown)
        key = "memory-text:" + ",".join(map(str, shown_ids))
        inserted = self._shown_messages(choice.shown)
        inserted_tokens = self._count(key, inserted, context.services) if inserted else 0
        return PolicyDecision(
            choice.sent,
            "recalled" if choice.shown else "rewritten",
            "; ".join(notes),
            inserted_tokens,
            recalled=shown_ids if choice.shown else None,
            schedule=choice.report,
        )

    @ends_with_an_event
    async def compact(
        self,
        request: PolicyRequest,
        context: PolicyContext,
        choice: Choice,
        plan: Plan,
        why: Trigger,
        notes: list[str],
        ahead: Ahead | None = None,
    ) -> PolicyDecision:
        """The compaction transaction: write the memory (or take the one
        written ahead), store it with the raw blocks, and only then send P +
        the memories chosen + the kept blocks."""
        cfg = self.config
        store, services, session = context.store, context.services, request.session_id
        view, budget, report = choice.view, choice.budget, choice.report
        searchable = choice.searchable
        original = request.conversation.messages()
        prefix = list(view.prefix)
        live = list(view.live)
        count, prefix_tokens, block_tokens = plan.count, plan.prefix_tokens, plan.block_tokens
        archived, kept = live[:count], live[count:]
        kept_tokens = sum(block_tokens[count:])
        # the memories shown take what the target leaves beside the prefix and the kept blocks,
        # within memory_share; the new one (its record has record_share) is shown whatever its size
        room = min(self._history_share() * budget.budget, max(0, budget.target - prefix_tokens - kept_tokens))
        if ahead is None:
            detail = {"blocks": len(archived), "sent_tokens": report.sent_tokens, "trigger": why}
            await store.log_event(session, "compression_started", detail)
        ratio = chars_per_token(archived, plan)
        waiting, ready = self.clock(), ahead is not None and ahead.task.done()
        try:
            if ahead is not None:
                text, embedding = await ahead.task
            else:
                record_chars = int(plan.record_tokens * ratio)
                text, embedding = await self.written.write(request, context, choice, archived, kept, record_chars)
        except (StoreError, StepFailure) as exc:
            rule, error = (
                (exc.rule, exc.detail) if isinstance(exc, StepFailure) else (Fallback.STORAGE_FAILURE, str(exc))
            )
            await store.log_event(session, rule.value, {"error": error})
            if ahead is not None:  # written in the background: unless the window needs one, no compaction now
                notes = [*notes, f"memory written ahead: {error}"]
                if choice.trigger == "window" and choice.plan is not None:
                    return await self.compact(request, context, choice, choice.plan, "window", notes)
                return self.send(request, context, choice, notes)
            return PolicyDecision.fallback(original, rule, error, schedule=report)
        # the memories shown after the compaction, and the request, before anything is stored
        next_id = max((m.id for m in searchable), default=0) + 1  # ids grow: it sorts where it will
        embedder = kind_embedder(self.kind, services)
        provisional = Memory(next_id, session, text, embedding, embedder, (), (), 0.0)
        candidates = [*searchable, provisional]
        if self.kind == "none":
            chosen: list[Memory] = []
        elif self.kind in MASKED_KINDS:
            chosen = self.shown.choose(candidates, None, int(room), self._masked_size(services))
        else:
            memory_chars = int(room * ratio)  # the newest is shown whatever its size
            query = captured_query(cfg, request, services, searchable) if searchable else None
            chosen = self.shown.choose(candidates, query, memory_chars)
        reduced = prefix + self._shown_messages(chosen) + flatten(kept)
        reduced_tokens = services.prompt_tokens(reduced, request.tools)
        window = services.max_model_len
        if ahead is not None and window and reduced_tokens + answer_room(request.answer_tokens, window) >= window:
            # the conversation outgrew the memory written ahead: one compaction that fits now
            await store.log_event(session, "compression_abandoned", {"blocks": len(archived), "reason": "window"})
            full = self.plan(view, budget, services)
            return await self.compact(request, context, choice, full, "window", notes)
        if reduced_tokens >= report.sent_tokens:
            await store.log_event(session, "compression_abandoned", {"blocks": len(archived), "reason": "no shrink"})
            return self.send(request, context, choice, [*notes, "compaction would not shrink the request"])
        cache_break = max(0, report.sent_tokens - prefix_tokens - block_tokens[-1])
        try:
            memory_id = await store.commit_memory(session, text, embedding, embedder, archived, step_details(archived))
        except Exception as exc:  # storage precedes removal: nothing is removed
            await store.log_event(session, Fallback.STORAGE_FAILURE.value, {"error": str(exc)})
            return PolicyDecision.fallback(original, Fallback.STORAGE_FAILURE, str(exc), schedule=report)
        final = [msgspec.structs.replace(m, id=memory_id) if m is provisional else m for m in chosen]
        summary = "inline" if self.later is None else "none"  # none: not written (KV pressure, or one pending)
        if self.later is not None and self.written.summarized(budget):
            committed = msgspec.structs.replace(provisional, id=memory_id)
            seen = self._shown_messages(choice.shown)  # what the engine saw before the archived blocks
            resend = self.written.resent(budget, prefix)
            summary = "after" if self.later.start(store, services, committed, archived, resend, seen) else "none"
        shown_ids = tuple(sorted(m.id for m in final))
        inserted = self._shown_messages(final)
        reduced = prefix + inserted + flatten(kept)
        reduced_tokens = services.prompt_tokens(reduced, request.tools)
        self.shown.keep(session, shown_ids)
        if request.prompt_tokens is not None:
            covered = view.covered + len(archived)
            self._offset[session] = Offset(covered, shown_ids, request.prompt_tokens - reduced_tokens)
        # counted before the end event, so that nothing fails after it
        inserted_tokens = services.count_tokens(inserted) if inserted else 0
        await store.log_event(
            session,
            "compressed",
            {
                "memory_id": memory_id,
                "blocks": len(archived),
                "trigger": why,
                "sent_tokens": report.sent_tokens,
                "cache_break_tokens": cache_break,
                "shown": list(shown_ids),
                "summary": summary,
            },
        )
        notes.append(f"{why}: archived {len(archived)} blocks as memory {memory_id}; cache break {cache_break} tokens")
        written = ahead.finished - ahead.started if ahead is not None and ahead.finished is not None else None
        seconds = written if ready and written is not None else self.clock() - waiting
        done = msgspec.structs.replace(
            report, trigger=why, cache_break_tokens=cache_break, memory_seconds=seconds, memory_ahead=ready
        )
        return PolicyDecision(
            reduced, "compressed", "; ".join(notes), inserted_tokens, recalled=shown_ids, schedule=done
        )
