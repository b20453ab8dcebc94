"""The shared memory store: one PostgreSQL database for many replicas.

Chosen by a URL (``PAMER_STORE=postgresql://user@host/db``). The tables and
the logic are ``sql.py``'s; what differs from SQLite:

* several processes write at once, so a transaction takes a per-session
  advisory lock (``pg_advisory_xact_lock``) before it reads the session's
  counts: two replicas compacting one session commit one after the other, the
  second sees the first's memory in its caps check, and a block archived twice
  hits the ``raw_blocks`` key and is refused whole (no duplicate memory);
* a schema of another version is refused with an error, never dropped: the
  database may be shared with other servers;
* a lost connection (a server restart, a failover) is opened again on the next
  call; the call that met the loss fails (the request falls back, nothing is
  removed).
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from vllm_pamer.core.store import StoreError, StoreLimits
from vllm_pamer.stores.responses import ResponsesSqlStore
from vllm_pamer.stores.sql import SCHEMA_VERSION

logger = logging.getLogger("vllm_pamer.store")

LOCK_TIMEOUT_MS = 10_000
"""Longest wait for a row or a session's lock (another replica's commit)."""
STATEMENT_TIMEOUT_MS = 30_000
"""Longest statement."""
_SCHEMA_LOCK = 0x70616D6572  # any constant: replicas starting together create the schema one at a time

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS memories (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    session TEXT NOT NULL,
    summary TEXT NOT NULL,
    embedding BYTEA NOT NULL,
    embedding_dim INTEGER NOT NULL,
    embedder TEXT NOT NULL,
    covered_block_ids TEXT NOT NULL,
    step_details TEXT NOT NULL,
    model_fingerprint TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS memories_session ON memories(session, id);
CREATE TABLE IF NOT EXISTS raw_blocks (
    session TEXT NOT NULL,
    block_id TEXT NOT NULL,
    memory_id BIGINT NOT NULL REFERENCES memories(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    messages TEXT NOT NULL,
    PRIMARY KEY (session, block_id)
);
CREATE INDEX IF NOT EXISTS raw_blocks_memory ON raw_blocks(memory_id);
CREATE TABLE IF NOT EXISTS events (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    session TEXT,
    time DOUBLE PRECISION NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_session ON events(session, id);
CREATE INDEX IF NOT EXISTS events_time ON events(time);
CREATE TABLE IF NOT EXISTS sessions (
    session TEXT PRIMARY KEY,
    last_used DOUBLE PRECISION NOT NULL,
    memories INTEGER NOT NULL,
    raw_bytes BIGINT NOT NULL,
    state BYTEA,
    state_time DOUBLE PRECISION NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sessions_last_used ON sessions(last_used);
CREATE TABLE IF NOT EXISTS responses (
    key TEXT PRIMARY KEY,
    parent TEXT,
    session TEXT NOT NULL,
    session_name TEXT NOT NULL,
    items TEXT NOT NULL,
    response TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_session ON responses(session);
"""


def redacted(url: str) -> str:
    """The URL's host, port and database, for messages (never the password)."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "<unparsable URL>"
    user, host, port, dbname = (parts.get(key, "") for key in ("user", "host", "port", "dbname"))
    return f"postgresql://{user}@{host}:{port}/{dbname}"


class PostgresStore(ResponsesSqlStore):
    """PostgreSQL-backed store; one connection per store object, shared by its
    threads behind the lock; each replica opens its own."""

    errors = (psycopg.Error,)

    def __init__(self, url: str, model_fingerprint: str = "", limits: StoreLimits | None = None) -> None:
        super().__init__(model_fingerprint, limits)
        self.url = url
        self._conn = self._connect()

    def _connect(self) -> psycopg.Connection[Any]:
        try:
            conn = psycopg.connect(
                self.url,
                autocommit=True,
                connect_timeout=10,
                application_name="vllm-pamer",
                # a stuck lock or statement fails the call (the request falls back) instead of the replica
                options=f"-c lock_timeout={LOCK_TIMEOUT_MS} -c statement_timeout={STATEMENT_TIMEOUT_MS}",
                keepalives=1,
                keepalives_idle=30,
            )
        except psycopg.Error as exc:
            raise StoreError(f"cannot reach the PostgreSQL store at {redacted(self.url)}: {exc}") from exc
        try:
            if self._current(conn):  # a reconnect: no DDL, whose locks would queue behind the replicas' writes
                return conn
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                conn.execute(_SCHEMA)
                row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                if row is None:
                    conn.execute("INSERT INTO meta VALUES ('schema_version', %s)", (str(SCHEMA_VERSION),))
                elif row[0] == "2":
                    conn.execute(
                        "ALTER TABLE sessions ADD COLUMN IF NOT EXISTS state BYTEA, "
                        "ADD COLUMN IF NOT EXISTS state_time DOUBLE PRECISION NOT NULL DEFAULT 0"
                    )
                    conn.execute("UPDATE meta SET value=%s WHERE key='schema_version'", (str(SCHEMA_VERSION),))
                elif row[0] == "3":  # 4 added the responses table, made by the schema above
                    conn.execute("UPDATE meta SET value=%s WHERE key='schema_version'", (str(SCHEMA_VERSION),))
                elif row[0] != str(SCHEMA_VERSION):
                    raise StoreError(
                        f"the PostgreSQL store at {redacted(self.url)} has schema version {row[0]}, this "
                        f"vllm-pamer writes {SCHEMA_VERSION}: point PAMER_STORE at another database"
                    )
        except psycopg.Error as exc:
            conn.close()
            raise StoreError(f"preparing the PostgreSQL store at {redacted(self.url)} failed: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def _current(conn: psycopg.Connection[Any]) -> bool:
        """The database holds this version's schema already."""
        try:
            row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except psycopg.errors.UndefinedTable:
            return False
        return row is not None and row[0] == str(SCHEMA_VERSION)

    @property
    def shared(self) -> bool:
        return True

    def _sql(self, query: str) -> str:
        return query.replace("?", "%s")

    def _lock_session(self, session: str) -> None:
        self._execute("SELECT pg_advisory_xact_lock(hashtextextended(?, 0))", (session,))

    def _try_lock_session(self, session: str) -> bool:
        (locked,) = self._execute("SELECT pg_try_advisory_xact_lock(hashtextextended(?, 0))", (session,)).fetchone()
        return bool(locked)

    def _ready(self) -> None:
        if self._conn.closed or self._conn.broken:
            logger.warning("vllm-pamer store: the PostgreSQL connection was lost; opening it again")
            self._conn = self._connect()
