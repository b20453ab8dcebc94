"""Summaries written after their compaction (``BudgetConfig.summary_after``).

The compaction commits its memory with the verbatim record alone (exact
values, no engine request: ``compaction_memory.py``), so the request that
compacts waits for no summary. The summary of the same blocks is written
here in the background, at most ``--pamer-summary-concurrency`` at once
(the engine services' own limit), and put before the record in the stored
memory, only if the memory still reads what it was committed with
(``MemoryStore.replace_memory_text``); its embedding, blocks and id stay, so
the worker's memory rows need no update (the memory is recalled by the
embedding it was committed with: the state captured at the session's
previous prompt, or its record embedded). What a request shows does not
change when it lands: the newest memory is shown by its record, older ones
by their summaries (``memory.shown_message``), and only a later compaction
chooses them. A summary that fails, or a server that stops before it ends,
leaves the memory as committed: nothing is lost, its events say why.

A session has at most one summary pending: a compaction while its previous
summary is still being written leaves its own unwritten (its memory keeps
its record). The summaries share the engine with the sessions' requests and
no request waits for them, so on a loaded engine nothing else holds them
back: they fall behind the compactions (``benchmarks/RESULTS.md``, "Every
mini-swe trajectory at the tight budget"). At most ``MAX_PENDING`` are
pending in all."""

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
"""Sessions with a summary waiting or being written: past it a compaction's
summary is not written (its memory keeps its record; each holds its blocks)."""


class SummariesAfter:
    """The summaries in the background, one per session at most, held until
    they end (an event loop keeps only weak references to its tasks)."""

    def __init__(self, writer: MemoryWriter, clock: Callable[[], float] = time.monotonic) -> None:
        self.writer, self.clock = writer, clock
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def pending(self, session: str) -> int:
        """The session's summaries still being written (0 or 1)."""
        return int(session in self._tasks)

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
        reads them. None: not written (the session's previous summary is still
        pending, or ``MAX_PENDING`` are)."""
        session = memory.session
        if session in self._tasks or len(self._tasks) >= MAX_PENDING:
            return None
        task = asyncio.ensure_future(self._write(store, services, memory, list(blocks), prefix, list(seen)))
        self._tasks[session] = task
        task.add_done_callback(lambda _: self._tasks.pop(session, None))
        return task

    async def drain(self) -> None:
        """Until every summary pending now has ended (the engine-free model lets them land between steps)."""
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

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
