"""Memories written ahead of need (``BudgetConfig.write_ahead``): the ones
in flight, one per session in a process, and their times. The flow of
requests under it is ``ahead_schedule.py``'s. Nothing is stored until the
compaction that takes a memory commits it with its raw blocks
(``budget_schedule.py``), so a crash while a memory is written ahead loses
nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cachetools import LRUCache

from vllm_pamer.core.policies.base import MAX_TRACKED_SESSIONS, Trigger

Written = tuple[str, np.ndarray]
"""A memory's text and embedding."""


@dataclass
class Ahead:
    """A memory being written ahead for one session."""

    block_ids: tuple[str, ...]
    """The blocks it archives: the oldest live blocks when it started."""
    trigger: Trigger
    started: float
    finished: float | None = field(default=None)
    """When the writing ended (the schedule's clock; None: still running)."""
    task: asyncio.Task[Written] = field(init=False)

    def covers(self, live_ids: Sequence[str]) -> bool:
        """Whether its blocks are still the oldest live ones (not archived by
        another process, the history not edited)."""
        return tuple(live_ids[: len(self.block_ids)]) == self.block_ids


def _settle(task: asyncio.Task[Written]) -> None:
    """Reads a failed task's exception, so an abandoned one is not reported
    as never retrieved (the compaction that awaits it handles the failure)."""
    if not task.cancelled():
        task.exception()


class _InFlight(LRUCache[str, Ahead]):
    """An evicted session's memory is cancelled: nothing would take it."""

    def popitem(self) -> tuple[str, Ahead]:
        session, ahead = super().popitem()
        ahead.task.cancel()
        return session, ahead


class AheadWrites:
    """The memories in flight, by session (least recently used dropped, and
    cancelled, past ``MAX_TRACKED_SESSIONS``)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._sessions = _InFlight(MAX_TRACKED_SESSIONS)

    def pending(self, session: str) -> Ahead | None:
        return self._sessions.get(session)

    def start(
        self, session: str, block_ids: Sequence[str], trigger: Trigger, work: Coroutine[Any, Any, Written]
    ) -> Ahead:
        ahead = Ahead(tuple(block_ids), trigger, self.clock())

        async def timed() -> Written:
            try:
                return await work
            finally:  # set before the task is done, so a done task has its time
                ahead.finished = self.clock()

        def settle(task: asyncio.Task[Written]) -> None:
            work.close()  # a task cancelled before it ran never started ``work``
            _settle(task)

        ahead.task = asyncio.ensure_future(timed())
        ahead.task.add_done_callback(settle)
        self._sessions[session] = ahead
        return ahead

    def take(self, session: str) -> Ahead | None:
        """The session's memory in flight, no longer tracked."""
        return self._sessions.pop(session, None)
