"""What only the SQLite store has (``stores/sqlite.py``): a corrupt file set
aside, a schema of another version treated as corrupt."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest

from tests.support.fakes import COMPRESS, FakeEngine, blocking, conversation
from tests.support.stores import BLOCKS, commit
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, PolicyRequest, create_policy
from vllm_pamer.stores.sqlite import SqliteStore


def test_corrupt_database_file_starts_empty(tmp_path):
    path = tmp_path / "memory.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    store = SqliteStore(path)
    assert store.reset_events and list(tmp_path.glob("memory.sqlite3.corrupt-*"))
    policy = create_policy("pamer", {"schedule": "paper"})  # the emptied store takes a compression
    outcome = asyncio.run(
        rewrite_request(
            policy,
            PolicyRequest(
                messages=conversation(8),
                session_id="s1",
                previous_vote=COMPRESS,
                context=PolicyContext(store, FakeEngine()),
            ),
        )
    )
    assert outcome.action == "compressed"


def test_schema_mismatch_is_treated_as_corrupt(tmp_path):
    path = tmp_path / "memory.sqlite3"
    SqliteStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value='999' WHERE key='schema_version'")
    conn.commit()
    conn.close()
    store = SqliteStore(path)
    assert "schema version 999" in store.reset_events[0]


def older_schema(path, script: str) -> None:
    """A store file at ``path`` with one memory of session "a", taken back to
    an older schema by the SQL ``script``."""
    store = SqliteStore(path)
    commit(store, "a")
    store.close()
    conn = sqlite3.connect(path)
    conn.executescript(script)
    conn.close()


def test_a_store_of_the_first_schema_is_carried_over(tmp_path):
    path = tmp_path / "m.sqlite3"
    older_schema(path, "DROP TABLE sessions; UPDATE meta SET value='1' WHERE key='schema_version';")
    reopened = SqliteStore(path)
    assert len(blocking(reopened).load("a").memories) == 1
    memories, raw_bytes = reopened._conn.execute(
        "SELECT memories, raw_bytes FROM sessions WHERE session='a'"
    ).fetchone()
    assert memories == 1 and raw_bytes == sum(len(json.dumps(list(b.messages))) for b in BLOCKS[:2])
    assert not [name for name in path.parent.iterdir() if "corrupt" in name.name]


def test_a_store_of_the_second_schema_is_carried_over(tmp_path):
    path = tmp_path / "m.sqlite3"
    older_schema(
        path,
        "ALTER TABLE sessions DROP COLUMN state; ALTER TABLE sessions DROP COLUMN state_time; "
        "UPDATE meta SET value='2' WHERE key='schema_version';",
    )
    reopened = SqliteStore(path)
    assert len(blocking(reopened).load("a").memories) == 1 and not reopened.reset_events
    blocking(reopened).save_session_state("a", b"state", 1.0)
    assert blocking(reopened).session_state("a") == (b"state", 1.0)


def test_a_store_of_the_third_schema_is_carried_over(tmp_path):
    path = tmp_path / "m.sqlite3"
    older_schema(path, "DROP TABLE responses; UPDATE meta SET value='3' WHERE key='schema_version';")
    reopened = SqliteStore(path)
    assert len(blocking(reopened).load("a").memories) == 1 and not reopened.reset_events
    blocking(reopened).hold_response("r1", None, ("a", "a"), [{"role": "user", "content": "hi"}], {"id": "r1"})
    assert blocking(reopened).held_response("r1").history == [{"role": "user", "content": "hi"}]


def test_a_busy_database_is_never_taken_for_a_corrupt_one(tmp_path):
    """Another process holds the write lock while a server opens the file (API
    processes starting together): the open fails after SQLite's busy wait,
    and the live file is not set aside."""
    path = tmp_path / "m.sqlite3"
    commit(SqliteStore(path), "a")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            SqliteStore(path)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert not [name for name in tmp_path.iterdir() if "corrupt" in name.name]
    assert len(blocking(SqliteStore(path)).load("a").memories) == 1
