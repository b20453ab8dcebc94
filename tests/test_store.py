"""The SQLite store's bounds (``StoreLimits``): per-session caps refuse a
commit and keep everything, retention deletes whole idle sessions (least
recently used first, never an active one), events are trimmed, and a store of
the first schema is carried over."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import numpy as np
import pytest

from tests.fakes import COMPRESS, FakeEngine, blocking, conversation
from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, create_policy
from vllm_pamer.core.policies.summary import step_details
from vllm_pamer.core.store import StoreError, StoreLimits
from vllm_pamer.stores.sqlite import SqliteStore

BLOCKS = split_conversation(conversation(6, chars=200)).blocks
VECTOR = np.ones(8, dtype=np.float32)


def commit(store, session, blocks=BLOCKS[:2]):
    return blocking(store).commit_memory(session, f"summary of {session}", VECTOR, "test", blocks, step_details(blocks))


def rows(store, table, session):
    return store._conn.execute(f"SELECT COUNT(*) FROM {table} WHERE session=?", (session,)).fetchone()[0]


def age(store, session, seconds):
    """Make ``session`` look last used ``seconds`` ago."""
    store._conn.execute("UPDATE sessions SET last_used=? WHERE session=?", (time.time() - seconds, session))


def test_a_commit_past_the_session_memory_cap_is_refused_and_keeps_everything(tmp_path):
    store = SqliteStore(tmp_path / "m.sqlite3", limits=StoreLimits(session_memories=2))
    commit(store, "a", BLOCKS[:2])
    commit(store, "a", BLOCKS[2:4])
    with pytest.raises(StoreError, match="session_memories"):
        commit(store, "a", BLOCKS[4:6])
    assert len(blocking(store).load("a").memories) == 2 and rows(store, "raw_blocks", "a") == 4
    commit(store, "b")  # another session has its own cap


def test_a_commit_past_the_session_raw_byte_cap_is_refused(tmp_path):
    size = sum(len(json.dumps(list(b.messages))) for b in BLOCKS[:2])
    store = SqliteStore(tmp_path / "m.sqlite3", limits=StoreLimits(session_raw_bytes=size + 10))
    commit(store, "a", BLOCKS[:2])
    with pytest.raises(StoreError, match="session_raw_bytes"):
        commit(store, "a", BLOCKS[2:4])
    assert rows(store, "memories", "a") == 1


def test_a_session_keeps_its_newest_events(tmp_path):
    store = SqliteStore(tmp_path / "m.sqlite3", limits=StoreLimits(session_events=3))
    for i in range(7):
        blocking(store).log_event("a", "step", {"i": i})
    blocking(store).log_event("b", "step", {"i": 0})
    assert [e["detail"]["i"] for e in blocking(store).events("a")] == [4, 5, 6]
    assert len(blocking(store).events("b")) == 1


def test_idle_sessions_are_deleted_whole_and_used_ones_kept(tmp_path):
    store = SqliteStore(tmp_path / "m.sqlite3", limits=StoreLimits(idle_s=100.0))
    for session in ("old", "new"):
        commit(store, session)
        blocking(store).log_event(session, "compressed")
    age(store, "old", 200)
    store._conn.execute("UPDATE events SET time=time-200 WHERE session='old'")
    commit(store, "other")  # a commit runs retention
    assert all(rows(store, table, "old") == 0 for table in ("memories", "raw_blocks", "events", "sessions"))
    assert rows(store, "memories", "new") == 1 and rows(store, "raw_blocks", "new") == 2


def test_a_load_counts_as_use(tmp_path):
    store = SqliteStore(tmp_path / "m.sqlite3", limits=StoreLimits(idle_s=100.0))
    commit(store, "a")
    age(store, "a", 200)
    blocking(store).load("a")  # the session's request came back before retention ran
    commit(store, "b")
    assert rows(store, "memories", "a") == 1


def test_total_caps_delete_the_least_recently_used_idle_session(tmp_path):
    store = SqliteStore(tmp_path / "m.sqlite3", limits=StoreLimits(total_memories=2, active_s=60.0))
    commit(store, "first")
    commit(store, "second")
    age(store, "first", 300)
    age(store, "second", 200)
    commit(store, "third")
    assert rows(store, "memories", "first") == 0 and rows(store, "raw_blocks", "first") == 0
    assert rows(store, "memories", "second") == 1 and rows(store, "memories", "third") == 1


def test_total_caps_never_delete_an_active_session_the_commit_is_refused(tmp_path):
    store = SqliteStore(tmp_path / "m.sqlite3", limits=StoreLimits(total_memories=2, active_s=60.0))
    commit(store, "a")
    commit(store, "b")
    with pytest.raises(StoreError, match="active"):
        commit(store, "c")
    assert rows(store, "memories", "a") == rows(store, "memories", "b") == 1 and rows(store, "memories", "c") == 0


def test_a_refused_commit_sends_the_original_request(tmp_path):
    """PaMER on a store at its cap: the storage-failure fallback, nothing removed."""
    store = SqliteStore(tmp_path / "m.sqlite3", limits=StoreLimits(session_memories=0))
    messages = conversation(8)
    policy = create_policy("pamer", {"schedule": "paper"})
    context = PolicyContext(store, FakeEngine())
    outcome = asyncio.run(rewrite_request(messages, "s1", policy, COMPRESS, context))
    assert outcome.action == "fallback:storage_failure" and "session_memories" in outcome.detail
    assert outcome.messages == messages


def test_a_store_of_the_first_schema_is_carried_over(tmp_path):
    path = tmp_path / "m.sqlite3"
    store = SqliteStore(path)
    commit(store, "a")
    store.close()
    conn = sqlite3.connect(path)
    conn.executescript("DROP TABLE sessions; UPDATE meta SET value='1' WHERE key='schema_version';")
    conn.close()
    reopened = SqliteStore(path)
    assert len(blocking(reopened).load("a").memories) == 1
    memories, raw_bytes = reopened._conn.execute(
        "SELECT memories, raw_bytes FROM sessions WHERE session='a'"
    ).fetchone()
    assert memories == 1 and raw_bytes == sum(len(json.dumps(list(b.messages))) for b in BLOCKS[:2])
    assert not [name for name in path.parent.iterdir() if "corrupt" in name.name]


def test_a_discarded_corrupt_memory_leaves_the_session_counts_right(tmp_path):
    store = SqliteStore(tmp_path / "m.sqlite3")
    commit(store, "a", BLOCKS[:2])
    bad = commit(store, "a", BLOCKS[2:4])
    store._conn.execute("UPDATE memories SET embedding=x'00' WHERE id=?", (bad,))
    assert blocking(store).load("a").discarded == 1
    memories, raw_bytes = store._conn.execute("SELECT memories, raw_bytes FROM sessions WHERE session='a'").fetchone()
    assert memories == 1 and raw_bytes == sum(len(json.dumps(list(b.messages))) for b in BLOCKS[:2])
