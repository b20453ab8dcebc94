"""Reads of a benchmark server's SQLite store while it runs and after a kill
(``benchmarks/adversarial.py``): the sessions' isolation, the store's
integrity, the blocks a kill could have lost, and a thread that kills the
server at a chosen event."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.server_process import ServerProcess


def isolation(store: Path, plans, records) -> dict[str, dict[str, int]]:
    """Per session: its memories, blocks they cover that are not the session's
    own, and recalled memory ids that are not the session's."""
    by_session: dict[str, str] = {}
    for record in records:
        by_session.setdefault(record.session_id, record.trajectory_key)
    own_blocks = {
        plan.key: {b.block_id for step in plan.steps for b in split_conversation(step.history).blocks} for plan in plans
    }
    conn = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    out = {}
    for session, key in by_session.items():
        rows = conn.execute("SELECT id, covered_block_ids FROM memories WHERE session=?", (session,)).fetchall()
        ids = {row[0] for row in rows}
        covered = {b for _, blocks in rows for b in json.loads(blocks)}
        recalled = {i for r in records if r.session_id == session for i in ((r.pamer or {}).get("recalled") or [])}
        out[session] = {
            "memories": len(rows),
            "foreign_blocks": len(covered - own_blocks[key]),
            "foreign_recalls": len(recalled - ids),
        }
    conn.close()
    return out


def store_check(path: Path) -> list[str]:
    """What is wrong with the store after a kill (nothing: [])."""
    conn = sqlite3.connect(path)
    try:
        problems = []
        if conn.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
            problems.append("integrity_check failed")
        orphans = conn.execute("SELECT COUNT(*) FROM raw_blocks WHERE memory_id NOT IN (SELECT id FROM memories)")
        if orphans.fetchone()[0]:
            problems.append("raw blocks without their memory")
        for memory_id, covered in conn.execute("SELECT id, covered_block_ids FROM memories").fetchall():
            stored = conn.execute("SELECT COUNT(*) FROM raw_blocks WHERE memory_id=?", (memory_id,)).fetchone()[0]
            if stored != len(json.loads(covered)):
                problems.append(f"memory {memory_id} without all its raw blocks")
        return problems
    finally:
        conn.close()


def lost_blocks(path: Path, session: str, history: list[dict], sent: list[dict]) -> int:
    """Blocks of ``history`` neither sent raw nor stored under one of the session's memories."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    stored = {row[0] for row in conn.execute("SELECT block_id FROM raw_blocks WHERE session=?", (session,))}
    conn.close()
    return sum(
        1
        for block in split_conversation(history).blocks
        if block.block_id not in stored and not all(m in sent for m in block.messages)
    )


class Killer(threading.Thread):
    """Watches the store's event log; SIGKILLs the server at the chosen point."""

    def __init__(
        self, server: ServerProcess, store: Path, point: str, delay_s: float, after_id: int, watch: str | None = None
    ) -> None:
        super().__init__(daemon=True)
        self.server, self.store, self.point, self.delay_s, self.after_id = server, store, point, delay_s, after_id
        self.watch = watch
        """The event the delay counts from (None: ``compression_started`` for ``during``, else ``compressed``)."""
        self.fired: str | None = None
        self.done = threading.Event()

    def run(self) -> None:
        kind = self.watch or ("compression_started" if self.point == "during" else "compressed")
        conn = sqlite3.connect(f"file:{self.store}?mode=ro", uri=True, check_same_thread=False)
        try:
            while not self.done.is_set():
                try:
                    row = conn.execute(
                        "SELECT id, kind FROM events WHERE id > ? AND kind = ? ORDER BY id LIMIT 1",
                        (self.after_id, kind),
                    ).fetchone()
                except sqlite3.Error:
                    row = None
                if row is not None:
                    time.sleep(self.delay_s)
                    self.fired = f"{self.point} (+{self.delay_s:.1f} s after {kind})"
                    self.server.kill()
                    return
                time.sleep(0.02)
        finally:
            conn.close()


def last_event_id(path: Path) -> int:
    if not path.exists():
        return 0
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT COALESCE(MAX(id), 0) FROM events").fetchone()[0]
    except sqlite3.Error:
        return 0
    finally:
        conn.close()
