"""Memories written ahead of need (``BudgetConfig.write_ahead``): when the
budget schedule calls for a compaction and the request still fits the window,
the memory of the blocks it would archive is written in the background and
the request goes out as it is (append-only); the session's first request
after the memory is ready compacts with it. Only a request the window cannot
hold waits for one. Nothing is stored until that compaction commits the
memory with its raw blocks (``budget_schedule.py``), so a crash while a
memory is written ahead loses nothing; one memory per session is in flight
in a process. Pure: asyncio only."""

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
    task: asyncio.Task[Written]
    started: float
    finished: float | None = field(default=None)
    """When the task ended (the schedule's clock; None: still running)."""

    def covers(self, live_ids: Sequence[str]) -> bool:
        """Whether its blocks are still the oldest live ones (not archived by
        another process, the history not edited)."""
        return tuple(live_ids[: len(self.block_ids)]) == self.block_ids


def _settle(task: asyncio.Task[Written]) -> None:
    """Reads a failed task's exception, so an abandoned one is not reported
    as never retrieved (the compaction that awaits it handles the failure)."""
    if not task.cancelled():
        task.exception()


class AheadWrites:
    """The memories in flight, by session (least recently used dropped past
    ``MAX_TRACKED_SESSIONS``; a dropped one is written to no effect)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._sessions: LRUCache[str, Ahead] = LRUCache(MAX_TRACKED_SESSIONS)

    def pending(self, session: str) -> Ahead | None:
        return self._sessions.get(session)

    def start(
        self, session: str, block_ids: Sequence[str], trigger: Trigger, work: Coroutine[Any, Any, Written]
    ) -> Ahead:
        task = asyncio.ensure_future(work)
        ahead = Ahead(tuple(block_ids), trigger, task, self.clock())

        def done(finished: asyncio.Task[Written]) -> None:
            ahead.finished = self.clock()
            _settle(finished)

        task.add_done_callback(done)
        self._sessions[session] = ahead
        return ahead

    def take(self, session: str) -> Ahead | None:
        """The session's memory in flight, no longer tracked."""
        return self._sessions.pop(session, None)
