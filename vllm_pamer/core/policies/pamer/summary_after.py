"""Summaries written after their compaction (``BudgetConfig.summary_after``).

The compaction commits its memory with the verbatim record alone (exact
values, no engine request: ``compaction_memory.py``), so the request that
compacts waits for no summary. The summary of the same blocks is written
here in the background, at most ``--pamer-summary-concurrency`` at once
(the engine services' own limit; at most ``MAX_PENDING`` wait in all, the
others are not written), and put before the record in the stored
memory, only if the memory still reads what it was committed with
(``MemoryStore.replace_memory_text``); its embedding, blocks and id stay, so
the worker's memory rows need no update (the memory is recalled by the
embedding it was committed with: the state captured at the session's
previous prompt, or its record embedded). What a request shows does not
change when it lands: the newest memory is shown by its record, older ones
by their summaries (``memory.shown_message``), and only a later compaction
chooses them. A summary that fails, or a server that stops before it ends,
leaves the memory as committed: nothing is lost, its events say why."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from vllm_pamer.core.blocks import Block, Message
from vllm_pamer.core.engine import EngineServices
from vllm_pamer.core.policies.base import MAX_TRACKED_SESSIONS
from vllm_pamer.core.policies.pamer.memory import MemoryWriter, with_summary
from vllm_pamer.core.policies.pamer.record import RECORD_HEADER
from vllm_pamer.core.policies.summary_writer import StepFailure
from vllm_pamer.core.store import Memory, MemoryStore

MAX_PENDING = MAX_TRACKED_SESSIONS
"""Summaries waiting or being written, in all sessions: past it a compaction's
summary is not written (its memory keeps its record; each holds its blocks)."""


class SummariesAfter:
    """The summaries in the background, held until they end (an event loop
    keeps only weak references to its tasks)."""

    def __init__(self, writer: MemoryWriter, clock: Callable[[], float] = time.monotonic) -> None:
        self.writer, self.clock = writer, clock
        self._tasks: dict[str, set[asyncio.Task[None]]] = {}

    def pending(self, session: str) -> int:
        """The session's summaries still being written."""
        return len(self._tasks.get(session, ()))

    def start(
        self,
        store: MemoryStore,
        services: EngineServices,
        memory: Memory,
        blocks: Sequence[Block],
        prefix: Sequence[Message] | None,
        seen: Sequence[Message],
    ) -> asyncio.Task[None] | None:
        """Write the summary of ``blocks`` (what ``memory`` archived) and add it
        to ``memory``; ``prefix`` and ``seen``: as ``MemoryWriter.summarize``
        reads them. None: ``MAX_PENDING`` are pending, this one is not written."""
        if sum(map(len, self._tasks.values())) >= MAX_PENDING:
            return None
        task = asyncio.ensure_future(self._write(store, services, memory, list(blocks), prefix, list(seen)))
        tasks = self._tasks.setdefault(memory.session, set())
        tasks.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            tasks.discard(finished)
            if not tasks:
                self._tasks.pop(memory.session, None)

        task.add_done_callback(done)
        return task

    async def drain(self) -> None:
        """Until every summary pending now has ended (the engine-free model lets them land between steps)."""
        pending = [task for tasks in self._tasks.values() for task in tasks]
        await asyncio.gather(*pending, return_exceptions=True)

    async def _write(
        self,
        store: MemoryStore,
        services: EngineServices,
        memory: Memory,
        blocks: list[Block],
        prefix: Sequence[Message] | None,
        seen: list[Message],
    ) -> None:
        started, session = self.clock(), memory.session
        reason = "the memory is gone or reads otherwise"
        try:
            summary = (await self.writer.summarize(blocks, services, prefix, seen)).strip()
            if not summary or RECORD_HEADER in summary:  # copied the record: the memory's parts would not split
                reason = "the summary is empty or repeats the record's header"
            elif await store.replace_memory_text(session, memory.id, memory.summary, with_summary(memory, summary)):
                seconds = round(self.clock() - started, 3)
                await store.log_event(session, "summary_added", {"memory_id": memory.id, "seconds": seconds})
                return
        except asyncio.CancelledError:  # the server is stopping: the memory keeps its record
            detail = {"memory_id": memory.id, "reason": "cancelled"}
            await asyncio.shield(store.log_event(session, "summary_not_added", detail))
            raise
        except StepFailure as exc:
            reason = exc.detail
        except Exception as exc:  # a background task has no caller to tell: its event says it
            reason = f"{type(exc).__name__}: {exc}"
        await store.log_event(session, "summary_not_added", {"memory_id": memory.id, "reason": reason})
