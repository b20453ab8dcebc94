"""What a budget-schedule compaction writes in place of the blocks it
archives, by kind (``memory.MemoryKind``): PaMER's summary and record, the
record alone, the blocks with their outputs masked, or nothing; with
``turns_share``, the newest archived turns after the record. ``rooms`` is
what the schedule's plan keeps free for it (``budget_schedule.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import numpy as np

from vllm_pamer.core.blocks import Block, Message
from vllm_pamer.core.engine import EngineServices
from vllm_pamer.core.policies.base import PolicyContext, PolicyRequest
from vllm_pamer.core.policies.pamer.budget import Budget, Choice
from vllm_pamer.core.policies.pamer.config import BudgetConfig
from vllm_pamer.core.policies.pamer.memory import (
    MASKED_KINDS,
    TURN_KINDS,
    MemoryKind,
    MemoryWriter,
    archived_blocks,
    masked_text,
    shown_messages,
    turn_messages,
    turns_text,
)
from vllm_pamer.core.policies.pamer.record import result_excerpts, step_record
from vllm_pamer.core.store import NO_EMBEDDING

TokenCount = Callable[[str, list[Message], EngineServices], int]
"""The schedule's token count of messages, cached under a key."""


class CompactionMemory:
    """A compaction's memory of one kind, for one schedule (its token counts)."""

    def __init__(self, config: BudgetConfig, writer: MemoryWriter, kind: MemoryKind, count: TokenCount) -> None:
        self.config, self.memory, self.kind = config, writer, kind
        self._count = count

    def rooms(self, budget: Budget) -> tuple[int, int]:
        """Tokens a new memory has for its record, and for the archived blocks
        it shows with their outputs masked (a masked history's ``memory_share``,
        the turns after a record's ``turns_share``)."""
        cfg = self.config
        recorded = self.kind in ("summary", "record", "excerpts") or self.kind in TURN_KINDS
        record = int(cfg.record_share * budget.budget) if recorded else 0
        share = cfg.memory_share if self.kind in MASKED_KINDS else cfg.turns_share if self.kind in TURN_KINDS else 0.0
        return record, int(share * budget.budget)

    async def write(
        self,
        request: PolicyRequest,
        context: PolicyContext,
        choice: Choice,
        archived: list[Block],
        kept: list[Block],
        record_chars: int,
    ) -> tuple[str, np.ndarray]:
        """The new memory's text and embedding, by kind (the record, which reads every archived step,
        off the event loop). Raises StoreError (the archived blocks could not be read) or StepFailure."""
        cfg, services, budget = self.config, context.services, choice.budget
        if self.kind == "none":
            return f"{len(archived)} steps archived by truncation (never shown)", NO_EMBEDDING
        if self.kind == "masked":
            return masked_text(archived), NO_EMBEDDING
        if self.kind == "excerpts":  # the record's choice of lines, placed in the outputs they come from
            excerpts = await asyncio.to_thread(result_excerpts, archived, kept, record_chars, choice.view.prefix)
            return masked_text(archived, excerpts), NO_EMBEDDING
        earlier = await archived_blocks(context.store, request.session_id, choice.searchable)
        # with turns: the newest archived blocks whole (outputs masked); the record of every step beside them
        room = self.rooms(budget)[1]
        turns = turn_messages(self._newest_turns(earlier + archived, room, services)) if self.kind in TURN_KINDS else []
        known = [*choice.view.prefix, *turns]
        record = await asyncio.to_thread(step_record, earlier + archived, kept, record_chars, known=known)
        if self.kind in ("record", "turns"):  # the newest record alone is shown: no embedding, no engine request
            return (record if self.kind == "record" else turns_text(record, turns)), NO_EMBEDDING
        if not self.summarized(budget) or cfg.summaries_after:  # no summary now
            embedding = await self.memory.embed(record, services, request.previous_state)
            return (record if self.kind == "summary" else turns_text(record, turns)), embedding
        resend = self.resent(budget, choice.view.prefix)
        seen = shown_messages(self.kind, choice.shown)  # what the engine saw before the archived blocks
        summary = await self.memory.summarize(archived, services, resend, seen)
        embedding = await self.memory.embed(summary, services)  # recalled by its summary
        text = f"{summary}\n\n{record}"
        return (text if self.kind == "summary" else turns_text(text, turns)), embedding

    def summarized(self, budget: Budget) -> bool:
        """Whether a compaction under ``budget`` gives its memory a summary (inline or after):
        not while KV pressure or ``kv_share`` has shrunk the budget with ``kv_pressure_summary`` off."""
        return not (budget.under_kv_pressure and not self.config.kv_pressure_summary)

    def resent(self, budget: Budget, prefix: Sequence[Message]) -> list[Message] | None:
        """The prefix a summary resends (the conversation layout), None for the text layout: under
        KV pressure the conversation is seldom still cached and the text layout prefills less; a
        budget held to the session's KV share keeps it cached."""
        scarce = budget.under_kv_pressure and not budget.shared
        return None if scarce and self.config.kv_pressure_summary_layout == "text" else list(prefix)

    def _newest_turns(self, blocks: list[Block], room: int, services: EngineServices) -> list[Block]:
        """The newest of ``blocks`` whose turns, outputs masked, fit ``room`` tokens together."""
        chosen: list[Block] = []
        used = 0
        for block in reversed(blocks):
            used += self._count("masked-block:" + block.block_id, turn_messages([block]), services)
            if used > room:
                break
            chosen.insert(0, block)
        return chosen
