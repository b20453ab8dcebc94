"""What the SQL backends share: the tables' use, the caps and retention of
``StoreLimits``, validation of what is read back, and the async interface.

Tables: ``memories`` (summary, embedding, covered block ids, step details),
``raw_blocks`` (the raw blocks each memory covers), ``events`` (every policy
decision), ``sessions`` (per session: last use, memories, raw bytes: what
the caps and retention read; and the server's state of the session) and
``responses`` (held Responses API answers: ``responses.py``). A backend (``sqlite.py``, ``postgres.py``) opens
the connection, creates its schema and says how a transaction begins and how a
session's commits are kept apart; the guarantees are the interface's
(``core/store.py``). Queries are written with ``?`` placeholders.
Calls run in worker threads (``asyncio.to_thread``) behind one lock per store
object, so the API server's event loop never waits on the database.

Longer than 400 lines: the one place the SQL of every memory operation is
written, for both backends; split, each part would reach into the same
lock, transaction and caps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import msgspec
import numpy as np

from vllm_pamer.core.blocks import Block, Message
from vllm_pamer.core.store import LoadResult, Memory, MemoryStore, StepDetail, StoreError, StoreLimits

logger = logging.getLogger("vllm_pamer.store")

SCHEMA_VERSION = 4
"""2 added the ``sessions`` table, 3 its ``state`` and ``state_time`` columns,
4 the ``responses`` table (``responses.py``)."""
PRUNE_EVERY = 1000
"""Events written between two retention passes (a commit runs one too)."""


class SqlStore(MemoryStore):
    """The shared logic over one DB-API connection (``self._conn``)."""

    BEGIN: ClassVar[str] = "BEGIN"
    """The statement that opens a write transaction."""
    errors: ClassVar[tuple[type[Exception], ...]] = ()
    """The driver's error classes: each becomes a StoreError or a log line."""

    def __init__(self, model_fingerprint: str = "", limits: StoreLimits | None = None) -> None:
        self.model_fingerprint = model_fingerprint
        self.limits = limits or StoreLimits()
        self._lock = threading.Lock()
        self._events_since_prune = 0
        self.reset_events: list[str] = []
        self._conn: Any = None

    @property
    def _logged_errors(self) -> tuple[type[Exception], ...]:
        """What a write that must never fail the request logs and swallows."""
        return (StoreError, *self.errors)

    # -- what a backend provides ----------------------------------------------------
    def _sql(self, query: str) -> str:
        """The query in the driver's placeholder style."""
        return query

    def _lock_session(self, session: str) -> None:
        """Inside a write transaction: keep other writers of ``session`` out
        until it ends (SQLite's ``BEGIN IMMEDIATE`` already keeps out all)."""

    def _try_lock_session(self, session: str) -> bool:
        """Like ``_lock_session`` without waiting: False when another writer
        holds the session (retention then leaves it alone)."""
        return True

    def _ready(self) -> None:
        """Before each call: reconnect a connection that was lost."""

    def _execute(self, query: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement; its cursor."""
        return self._conn.execute(self._sql(query), params)

    def _executemany(self, query: str, rows: Sequence[Sequence[Any]]) -> None:
        if rows:
            self._conn.cursor().executemany(self._sql(query), rows)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction, committed or rolled back whole; the caller holds the lock."""
        self._execute(self.BEGIN)
        try:
            yield
            self._execute("COMMIT")
        except BaseException:
            try:
                self._execute("ROLLBACK")
            except self.errors:  # a lost connection rolled it back already
                logger.warning("vllm-pamer store: rollback failed", exc_info=True)
            raise

    # -- writes -------------------------------------------------------------------
    def _commit_memory(
        self,
        session: str,
        summary: str,
        embedding: np.ndarray,
        embedder: str,
        blocks: Sequence[Block],
        step_details: Sequence[StepDetail],
    ) -> int:
        """Store a memory and the raw blocks it covers, atomically; return its id."""
        vector = np.asarray(embedding, dtype="<f4").reshape(-1)
        if not summary.strip():
            raise StoreError("refusing to store an empty summary")
        if vector.size == 0 or not np.isfinite(vector).all():
            raise StoreError("refusing to store an empty or non-finite embedding")
        ids = [block.block_id for block in blocks]
        raw = [json.dumps(list(block.messages)) for block in blocks]
        size = sum(len(text) for text in raw)
        try:
            with self._lock:
                self._ready()
                with self._transaction():
                    self._lock_session(session)
                    now = time.time()
                    self._check_caps(session, size, now)
                    (memory_id,) = self._execute(
                        "INSERT INTO memories (session, summary, embedding, embedding_dim, embedder, "
                        "covered_block_ids, step_details, model_fingerprint, created) "
                        "VALUES (?,?,?,?,?,?,?,?,?) RETURNING id",
                        (
                            session,
                            summary,
                            vector.tobytes(),
                            int(vector.size),
                            embedder,
                            json.dumps(ids),
                            msgspec.json.encode(step_details).decode(),
                            self.model_fingerprint,
                            now,
                        ),
                    ).fetchone()
                    self._executemany(
                        "INSERT INTO raw_blocks (session, block_id, memory_id, position, messages) VALUES (?,?,?,?,?)",
                        [
                            (session, block.block_id, memory_id, detail.step, text)
                            for block, detail, text in zip(blocks, step_details, raw)
                        ],
                    )
                    self._execute(
                        "INSERT INTO sessions (session, last_used, memories, raw_bytes) VALUES (?,?,1,?) "
                        "ON CONFLICT(session) DO UPDATE SET last_used=excluded.last_used, "
                        "memories=sessions.memories+1, raw_bytes=sessions.raw_bytes+excluded.raw_bytes",
                        (session, now, size),
                    )
        except self.errors as exc:
            raise StoreError(f"storing the memory failed: {exc}") from exc
        return int(memory_id)

    def _replace_memory_text(self, session: str, memory_id: int, old: str, new: str) -> bool:
        if not new.strip():
            raise StoreError("refusing to store an empty memory text")
        try:
            with self._lock:
                self._ready()
                with self._transaction():
                    self._lock_session(session)
                    cursor = self._execute(
                        "UPDATE memories SET summary=? WHERE id=? AND session=? AND summary=?",
                        (new, memory_id, session, old),
                    )
                    return bool(cursor.rowcount == 1)
        except self.errors as exc:
            raise StoreError(f"replacing the memory's text failed: {exc}") from exc

    def _log_event(self, session: str | None, kind: str, detail: dict[str, Any] | None = None) -> None:
        """Record a decision; a failing event log never fails the request."""
        try:
            with self._lock:
                self._ready()
                self._log(session, kind, detail or {})
                if session is not None:  # the session's newest ``session_events``
                    self._execute(
                        "DELETE FROM events WHERE session=? AND id <= "
                        "(SELECT id FROM events WHERE session=? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                        (session, session, self.limits.session_events),
                    )
                self._events_since_prune += 1
                if self._events_since_prune >= PRUNE_EVERY:
                    with self._transaction():
                        self._prune(time.time())
        except self._logged_errors:
            logger.exception("vllm-pamer store: event log write or retention failed")

    def _log(self, session: str | None, kind: str, detail: dict[str, Any]) -> None:
        self._execute(
            "INSERT INTO events (session, time, kind, detail) VALUES (?,?,?,?)",
            (session, time.time(), kind, json.dumps(detail, default=str)),
        )

    def _save_session_state(self, session: str, state: bytes, updated: float) -> None:
        try:
            with self._lock:
                self._ready()
                self._execute(
                    "INSERT INTO sessions (session, last_used, memories, raw_bytes, state, state_time) "
                    "VALUES (?,?,0,0,?,?) ON CONFLICT(session) DO UPDATE SET last_used=excluded.last_used, "
                    "state=excluded.state, state_time=excluded.state_time "
                    "WHERE sessions.state_time < excluded.state_time",
                    (session, time.time(), state, updated),
                )
        except self._logged_errors:
            logger.exception("vllm-pamer store: saving the session's state failed")

    # -- bounds (``StoreLimits``); the callers hold the lock inside a transaction --
    def _check_caps(self, session: str, size: int, now: float) -> None:
        """Refuse a memory of ``size`` raw bytes that would pass a cap, after
        retention has freed what it may."""
        limits = self.limits
        row = self._execute("SELECT memories, raw_bytes FROM sessions WHERE session=?", (session,)).fetchone()
        memories, raw_bytes = row or (0, 0)
        if memories + 1 > limits.session_memories:
            raise StoreError(f"the session holds {memories} memories, its cap (session_memories)")
        if raw_bytes + size > limits.session_raw_bytes:
            raise StoreError(
                f"the session's raw blocks would take {raw_bytes + size} bytes, over its cap (session_raw_bytes)"
            )
        self._prune(now, keep=session, room=(1, size))

    def _totals(self) -> tuple[int, int]:
        memories, raw_bytes = self._execute(
            "SELECT COALESCE(SUM(memories), 0), COALESCE(SUM(raw_bytes), 0) FROM sessions"
        ).fetchone()
        return int(memories), int(raw_bytes)

    def _prune(self, now: float, keep: str | None = None, room: tuple[int, int] = (0, 0)) -> None:
        """Retention: delete sessions idle past ``idle_s``, then the least
        recently used ones (idle past ``active_s``, never ``keep``) until the
        totals leave ``room`` (memories, raw bytes); drop the oldest events
        past ``total_events``. Raises StoreError when the room cannot be made."""
        limits = self.limits
        self._events_since_prune = 0
        if limits.idle_s:
            cutoff = now - limits.idle_s
            for (victim,) in self._execute("SELECT session FROM sessions WHERE last_used < ?", (cutoff,)).fetchall():
                if victim != keep and self._try_lock_session(victim):
                    self._delete_session(victim, "idle")
            self._execute("DELETE FROM events WHERE time < ?", (cutoff,))
        memories, raw_bytes = self._totals()
        busy: list[str] = [keep or ""]
        while memories + room[0] > limits.total_memories or raw_bytes + room[1] > limits.total_raw_bytes:
            row = self._execute(
                "SELECT session, memories, raw_bytes FROM sessions WHERE last_used < ? AND memories > 0 "
                f"AND session NOT IN ({','.join('?' * len(busy))}) ORDER BY last_used LIMIT 1",
                (now - limits.active_s, *busy),
            ).fetchone()
            if row is None:
                raise StoreError("the store is at its total caps and every session in it is active")
            if not self._try_lock_session(row[0]):  # another replica is writing it: it is in use
                busy.append(row[0])
                continue
            self._delete_session(row[0], "least recently used")
            memories, raw_bytes = memories - row[1], raw_bytes - row[2]
        (events,) = self._execute("SELECT COUNT(*) FROM events").fetchone()
        if events > limits.total_events:
            self._execute(
                "DELETE FROM events WHERE id IN (SELECT id FROM events ORDER BY id LIMIT ?)",
                (events - limits.total_events,),
            )

    def _delete_session(self, session: str, why: str) -> None:
        """A whole session: its memories with their raw blocks, its events and held responses."""
        for table in ("raw_blocks", "memories", "events", "responses", "sessions"):
            self._execute(f"DELETE FROM {table} WHERE session=?", (session,))
        logger.info("vllm-pamer store: deleted session %s (%s)", session, why)

    # -- reads ----------------------------------------------------------------------
    def _load(self, session: str) -> LoadResult:
        """All valid memories of ``session`` (oldest first). Rows that fail
        validation are deleted with their raw blocks and counted."""
        try:
            with self._lock:
                self._ready()
                rows = self._execute(
                    "SELECT id, summary, embedding, embedding_dim, embedder, covered_block_ids, step_details, "
                    "created, (SELECT COUNT(*) FROM raw_blocks r WHERE r.memory_id = m.id) "
                    "FROM memories m WHERE session=? ORDER BY id",
                    (session,),
                ).fetchall()
        except self.errors as exc:
            raise StoreError(f"loading session memory failed: {exc}") from exc
        memories, bad = [], []
        for row in rows:
            memory = self._validate(session, row)
            if memory is None:
                bad.append(row[0])
            else:
                memories.append(memory)
        if not rows:  # nothing stored for the session: nothing to record
            return LoadResult(memories)
        try:
            with self._lock, self._transaction():
                self._lock_session(session)
                if bad:  # corrupt state: discard it and start from what is valid; never repair
                    self._executemany("DELETE FROM raw_blocks WHERE memory_id=?", [(i,) for i in bad])
                    self._executemany("DELETE FROM memories WHERE id=?", [(i,) for i in bad])
                    self._execute(
                        "UPDATE sessions SET memories=(SELECT COUNT(*) FROM memories WHERE session=?), "
                        "raw_bytes=COALESCE((SELECT SUM(LENGTH(messages)) FROM raw_blocks WHERE session=?), 0) "
                        "WHERE session=?",
                        (session, session, session),
                    )
                self._execute("UPDATE sessions SET last_used=? WHERE session=?", (time.time(), session))
        except self.errors:  # the valid memories are still served; the discard waits for the next load
            logger.exception("vllm-pamer store: recording the session's use failed")
        if bad:
            self._log_event(session, "corrupt_state", {"discarded_memory_ids": bad})
        return LoadResult(memories, discarded=len(bad))

    @staticmethod
    def _validate(session: str, row: Sequence[Any]) -> Memory | None:
        memory_id, summary, blob, dim, embedder, covered, details, created, n_raw = row
        try:
            if not isinstance(summary, str) or not summary.strip():
                return None
            if isinstance(blob, memoryview):
                blob = blob.tobytes()
            if not isinstance(blob, bytes) or len(blob) != 4 * int(dim) or int(dim) <= 0:
                return None
            vector = np.frombuffer(blob, dtype="<f4").copy()
            if not np.isfinite(vector).all():
                return None
            covered_ids = tuple(json.loads(covered))
            step_details = msgspec.json.decode(details, type=tuple[StepDetail, ...])
            if not covered_ids or len(covered_ids) != n_raw or [d.block_id for d in step_details] != list(covered_ids):
                return None  # a memory must come with exactly the raw blocks it covers
        except (ValueError, TypeError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        return Memory(int(memory_id), session, summary, vector, embedder, covered_ids, step_details, float(created))

    def _session_state(self, session: str) -> tuple[bytes, float] | None:
        try:
            with self._lock:
                self._ready()
                row = self._execute("SELECT state, state_time FROM sessions WHERE session=?", (session,)).fetchone()
        except self.errors as exc:
            raise StoreError(f"reading the session's state failed: {exc}") from exc
        if row is None or row[0] is None:
            return None
        return bytes(row[0]), float(row[1])

    def _raw_blocks(self, session: str, block_ids: Sequence[str]) -> dict[str, list[Message]]:
        if not block_ids:
            return {}
        try:
            with self._lock:
                self._ready()
                rows = self._execute(
                    "SELECT block_id, messages FROM raw_blocks "
                    f"WHERE session=? AND block_id IN ({','.join('?' * len(block_ids))})",
                    (session, *block_ids),
                ).fetchall()
        except self.errors as exc:
            raise StoreError(f"reading raw blocks failed: {exc}") from exc
        return {block_id: json.loads(messages) for block_id, messages in rows}

    def _events(self, session: str, limit: int = 100) -> list[dict[str, Any]]:
        try:
            with self._lock:
                self._ready()
                rows = self._execute(
                    "SELECT time, kind, detail FROM events WHERE session=? ORDER BY id DESC LIMIT ?", (session, limit)
                ).fetchall()
        except self.errors as exc:
            raise StoreError(f"reading events failed: {exc}") from exc
        return [{"time": t, "kind": k, "detail": json.loads(d)} for t, k, d in reversed(rows)]

    # -- the interface: each call in a worker thread ------------------------------
    async def load(self, session: str) -> LoadResult:
        return await asyncio.to_thread(self._load, session)

    async def commit_memory(
        self,
        session: str,
        summary: str,
        embedding: np.ndarray,
        embedder: str,
        blocks: Sequence[Block],
        step_details: Sequence[StepDetail],
    ) -> int:
        return await asyncio.to_thread(self._commit_memory, session, summary, embedding, embedder, blocks, step_details)

    async def replace_memory_text(self, session: str, memory_id: int, old: str, new: str) -> bool:
        return await asyncio.to_thread(self._replace_memory_text, session, memory_id, old, new)

    async def raw_blocks(self, session: str, block_ids: Sequence[str]) -> dict[str, list[Message]]:
        return await asyncio.to_thread(self._raw_blocks, session, block_ids)

    async def log_event(self, session: str | None, kind: str, detail: dict[str, Any] | None = None) -> None:
        await asyncio.to_thread(self._log_event, session, kind, detail)

    async def events(self, session: str, limit: int = 100) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._events, session, limit)

    async def save_session_state(self, session: str, state: bytes, updated: float) -> None:
        await asyncio.to_thread(self._save_session_state, session, state, updated)

    async def session_state(self, session: str) -> tuple[bytes, float] | None:
        return await asyncio.to_thread(self._session_state, session)
