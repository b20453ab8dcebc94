"""The embedded memory store: one SQLite file (WAL) per server.

The tables and the logic are ``sql.py``'s; this file opens the file, creates
or carries over the schema, and sets a corrupt file aside. ``BEGIN IMMEDIATE``
takes the write lock at the start of a transaction, so writers (threads, or
processes sharing the file) are serialized and a commit's caps check reads
what the previous commit wrote.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

from vllm_pamer.core.store import StoreLimits
from vllm_pamer.stores.responses import ResponsesSqlStore
from vllm_pamer.stores.sql import SCHEMA_VERSION

logger = logging.getLogger("vllm_pamer.store")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS memories (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session TEXT NOT NULL,
    summary TEXT NOT NULL,
    embedding BLOB NOT NULL,
    embedding_dim INTEGER NOT NULL,
    embedder TEXT NOT NULL,
    covered_block_ids TEXT NOT NULL,
    step_details TEXT NOT NULL,
    model_fingerprint TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS memories_session ON memories(session, id);
CREATE TABLE IF NOT EXISTS raw_blocks (
    session TEXT NOT NULL,
    block_id TEXT NOT NULL,
    memory_id INTEGER NOT NULL REFERENCES memories(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    messages TEXT NOT NULL,
    PRIMARY KEY (session, block_id)
);
CREATE INDEX IF NOT EXISTS raw_blocks_memory ON raw_blocks(memory_id);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session TEXT,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_session ON events(session, id);
CREATE TABLE IF NOT EXISTS sessions (
    session TEXT PRIMARY KEY,
    last_used REAL NOT NULL,
    memories INTEGER NOT NULL,
    raw_bytes INTEGER NOT NULL,
    state BLOB,
    state_time REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sessions_last_used ON sessions(last_used);
CREATE TABLE IF NOT EXISTS responses (
    key TEXT PRIMARY KEY,
    parent TEXT,
    session TEXT NOT NULL,
    session_name TEXT NOT NULL,
    items TEXT NOT NULL,
    response TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_session ON responses(session);
"""

# Version 1 had no sessions table: fill it from the memories it kept.
_FROM_V1 = """
INSERT OR REPLACE INTO sessions (session, last_used, memories, raw_bytes)
SELECT m.session, MAX(m.created), COUNT(*),
       COALESCE((SELECT SUM(LENGTH(r.messages)) FROM raw_blocks r WHERE r.session = m.session), 0)
FROM memories m GROUP BY m.session;
"""
# Version 2 kept no session state.
_FROM_V2 = """
ALTER TABLE sessions ADD COLUMN state BLOB;
ALTER TABLE sessions ADD COLUMN state_time REAL NOT NULL DEFAULT 0;
"""


class SqliteStore(ResponsesSqlStore):
    """SQLite-backed store; safe to share between threads of one process."""

    BEGIN = "BEGIN IMMEDIATE"
    errors = (sqlite3.Error,)

    def __init__(self, path: str | os.PathLike, model_fingerprint: str = "", limits: StoreLimits | None = None) -> None:
        super().__init__(model_fingerprint, limits)
        self.path = Path(path)
        self._conn = self._open()

    # -- opening, with recovery from a corrupt file -----------------------------
    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self._connect()
        except (sqlite3.OperationalError, sqlite3.IntegrityError):
            raise  # a busy or racing database is not a corrupt one: never set a live file aside
        except sqlite3.DatabaseError as exc:
            # Corrupt file or foreign schema: keep it aside for inspection, start empty.
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):
                Path(str(self.path) + suffix).unlink(missing_ok=True)
            self.reset_events.append(f"corrupt database moved to {aside.name}: {exc}")
            logger.warning("vllm-pamer store: %s", self.reset_events[-1])
            self._conn = self._connect()
            self._log(None, "corrupt_state", {"reason": str(exc), "moved_to": aside.name})
            return self._conn

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            # one transaction, so API processes opening the file at once create and carry it over once
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                if row is None:
                    conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                elif row[0] in ("1", "2", "3"):  # the schema above made the tables an older one lacked
                    for statement in {"1": _FROM_V1, "2": _FROM_V2, "3": ""}[row[0]].split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
                elif row[0] != str(SCHEMA_VERSION):
                    raise sqlite3.DatabaseError(f"schema version {row[0]}, expected {SCHEMA_VERSION}")
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.DatabaseError:
            conn.close()
            raise
        return conn
