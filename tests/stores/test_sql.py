"""The store suite of what the SQL backends share (``stores/sql.py``), run on
each backend (SQLite and a throw-away PostgreSQL, ``make_store`` in
tests/conftest.py): atomic commits, isolated sessions, corrupt rows
discarded, the bounds of ``StoreLimits`` (per-session caps refuse a commit and
keep everything, retention deletes whole idle sessions, least recently used
first, never an active one; events are trimmed), and writers of one session in
several store objects at once (replicas) that neither lose nor duplicate a
memory. What one backend alone has: test_sqlite.py, test_postgres.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.support.fakes import COMPRESS, FakeEngine, blocking, conversation
from tests.support.stores import BLOCKS, VECTOR, commit
from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, PolicyRequest, create_policy
from vllm_pamer.core.store import StoreError, StoreLimits
from vllm_pamer.stores.sqlite import SqliteStore


def rows(store, table, session):
    return store._execute(f"SELECT COUNT(*) FROM {table} WHERE session=?", (session,)).fetchone()[0]


def age(store, session, seconds):
    """Make ``session`` look last used ``seconds`` ago."""
    store._execute("UPDATE sessions SET last_used=? WHERE session=?", (time.time() - seconds, session))


def fail_raw_block_inserts(store):
    """A real database failure after the memory row was inserted."""
    if isinstance(store, SqliteStore):
        store._execute("CREATE TRIGGER fail BEFORE INSERT ON raw_blocks BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    else:
        store._execute(
            "CREATE FUNCTION fail() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'disk full'; END $$"
        )
        store._execute("CREATE TRIGGER fail BEFORE INSERT ON raw_blocks FOR EACH ROW EXECUTE FUNCTION fail()")


def test_a_commit_past_the_session_memory_cap_is_refused_and_keeps_everything(make_store):
    store = make_store(StoreLimits(session_memories=2))
    commit(store, "a", BLOCKS[:2])
    commit(store, "a", BLOCKS[2:4])
    with pytest.raises(StoreError, match="session_memories"):
        commit(store, "a", BLOCKS[4:6])
    assert len(blocking(store).load("a").memories) == 2 and rows(store, "raw_blocks", "a") == 4
    commit(store, "b")  # another session has its own cap


def test_a_commit_past_the_session_raw_byte_cap_is_refused(make_store):
    size = sum(len(json.dumps(list(b.messages))) for b in BLOCKS[:2])
    store = make_store(StoreLimits(session_raw_bytes=size + 10))
    commit(store, "a", BLOCKS[:2])
    with pytest.raises(StoreError, match="session_raw_bytes"):
        commit(store, "a", BLOCKS[2:4])
    assert rows(store, "memories", "a") == 1


def test_a_session_keeps_its_newest_events(make_store):
    store = make_store(StoreLimits(session_events=3))
    for i in range(7):
        blocking(store).log_event("a", "step", {"i": i})
    blocking(store).log_event("b", "step", {"i": 0})
    assert [e["detail"]["i"] for e in blocking(store).events("a")] == [4, 5, 6]
    assert len(blocking(store).events("b")) == 1


def test_idle_sessions_are_deleted_whole_and_used_ones_kept(make_store):
    store = make_store(StoreLimits(idle_s=100.0))
    for session in ("old", "new"):
        commit(store, session)
        blocking(store).log_event(session, "compressed")
    age(store, "old", 200)
    store._execute("UPDATE events SET time=time-200 WHERE session='old'")
    commit(store, "other")  # a commit runs retention
    assert all(rows(store, table, "old") == 0 for table in ("memories", "raw_blocks", "events", "sessions"))
    assert rows(store, "memories", "new") == 1 and rows(store, "raw_blocks", "new") == 2


def test_a_load_counts_as_use(make_store):
    store = make_store(StoreLimits(idle_s=100.0))
    commit(store, "a")
    age(store, "a", 200)
    blocking(store).load("a")  # the session's request came back before retention ran
    commit(store, "b")
    assert rows(store, "memories", "a") == 1


def test_total_caps_delete_the_least_recently_used_idle_session(make_store):
    store = make_store(StoreLimits(total_memories=2, active_s=60.0))
    commit(store, "first")
    commit(store, "second")
    age(store, "first", 300)
    age(store, "second", 200)
    commit(store, "third")
    assert rows(store, "memories", "first") == 0 and rows(store, "raw_blocks", "first") == 0
    assert rows(store, "memories", "second") == 1 and rows(store, "memories", "third") == 1


def test_total_caps_never_delete_an_active_session_the_commit_is_refused(make_store):
    store = make_store(StoreLimits(total_memories=2, active_s=60.0))
    commit(store, "a")
    commit(store, "b")
    with pytest.raises(StoreError, match="active"):
        commit(store, "c")
    assert rows(store, "memories", "a") == rows(store, "memories", "b") == 1 and rows(store, "memories", "c") == 0


def test_a_refused_commit_sends_the_original_request(make_store):
    """PaMER on a store at its cap: the storage-failure fallback, nothing removed."""
    store = make_store(StoreLimits(session_memories=0))
    messages = conversation(8)
    policy = create_policy("pamer", {"schedule": "paper"})
    context = PolicyContext(store, FakeEngine())
    outcome = asyncio.run(
        rewrite_request(
            policy, PolicyRequest(messages=messages, session_id="s1", previous_vote=COMPRESS, context=context)
        )
    )
    assert outcome.action == "fallback:storage_failure" and "session_memories" in outcome.detail
    assert outcome.messages == messages


def test_a_discarded_corrupt_memory_leaves_the_session_counts_right(make_store):
    store = make_store()
    commit(store, "a", BLOCKS[:2])
    bad = commit(store, "a", BLOCKS[2:4])
    store._execute("UPDATE memories SET embedding=? WHERE id=?", (b"\x00", bad))
    assert blocking(store).load("a").discarded == 1
    memories, raw_bytes = store._execute("SELECT memories, raw_bytes FROM sessions WHERE session='a'").fetchone()
    assert memories == 1 and raw_bytes == sum(len(json.dumps(list(b.messages))) for b in BLOCKS[:2])


def test_a_failure_mid_transaction_leaves_no_memory(make_store):
    store = make_store()
    fail_raw_block_inserts(store)
    messages = conversation(8)
    policy = create_policy("pamer", {"schedule": "paper"})
    outcome = asyncio.run(
        rewrite_request(
            policy,
            PolicyRequest(
                messages=messages, session_id="s1", previous_vote=COMPRESS, context=PolicyContext(store, FakeEngine())
            ),
        )
    )
    assert outcome.action == "fallback:storage_failure" and "disk full" in outcome.detail
    assert outcome.messages == messages
    assert store._execute("SELECT COUNT(*) FROM memories").fetchone()[0] == 0
    assert blocking(store).load("s1").memories == []


def test_corrupt_rows_are_discarded_with_their_raw_blocks(make_store):
    store = make_store()
    commit(store, "a")
    store._execute("UPDATE memories SET covered_block_ids=?", ("not json",))
    result = blocking(store).load("a")
    assert result.memories == [] and result.discarded == 1
    assert rows(store, "raw_blocks", "a") == 0
    assert [e["kind"] for e in blocking(store).events("a")] == ["corrupt_state"]


def test_sessions_are_isolated(make_store):
    store = make_store()
    commit(store, "a")
    blocking(store).log_event("a", "compressed")
    assert blocking(store).load("b").memories == [] and blocking(store).events("b") == []
    assert blocking(store).raw_blocks("b", [BLOCKS[0].block_id]) == {}
    assert list(blocking(store).raw_blocks("a", [BLOCKS[0].block_id])) == [BLOCKS[0].block_id]


def test_memories_survive_a_reopen(make_store):
    first = make_store()
    memory_id = commit(first, "a")
    first.close()
    [memory] = blocking(make_store()).load("a").memories
    assert memory.id == memory_id and memory.summary == "summary of a"
    assert np.array_equal(memory.embedding, VECTOR)
    assert memory.covered_block_ids == tuple(b.block_id for b in BLOCKS[:2])


def _at_once(calls):
    """Run the calls in threads released together; each result or exception."""
    barrier = threading.Barrier(len(calls))

    def run(call):
        barrier.wait()
        try:
            return call()
        except StoreError as exc:
            return exc

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def test_two_replicas_archiving_the_same_blocks_store_one_memory(make_store):
    """Two store objects (two replicas) compact one session at once with the
    same blocks: one memory is stored, the other commit is refused whole."""
    replicas = [make_store(), make_store()]
    results = _at_once([lambda store=store: commit(store, "s") for store in replicas])
    assert sum(isinstance(r, int) for r in results) == 1, results
    assert sum(isinstance(r, StoreError) for r in results) == 1
    assert len(blocking(replicas[1]).load("s").memories) == 1
    assert rows(replicas[0], "raw_blocks", "s") == 2
    assert replicas[0]._execute("SELECT memories FROM sessions WHERE session='s'").fetchone()[0] == 1


def test_concurrent_writers_on_one_session_lose_nothing_and_keep_the_cap(make_store):
    """Four replicas commit distinct blocks of one session at once, then past
    its cap: every commit below the cap is stored, the counts add up, and the
    cap holds against the race."""
    blocks = split_conversation(conversation(16, chars=100)).blocks
    replicas = [make_store(StoreLimits(session_memories=6)) for _ in range(4)]
    pairs = [blocks[i : i + 2] for i in range(0, 16, 2)]  # 8 memories' worth, cap 6
    results = _at_once([lambda i=i, pair=pair: commit(replicas[i % 4], "s", pair) for i, pair in enumerate(pairs)])
    stored = [r for r in results if isinstance(r, int)]
    assert len(stored) == 6 and len(set(stored)) == 6, results
    assert all("session_memories" in str(r) for r in results if isinstance(r, StoreError))
    memories = blocking(replicas[0]).load("s").memories
    assert sorted(m.id for m in memories) == sorted(stored)
    count, raw_bytes = replicas[1]._execute("SELECT memories, raw_bytes FROM sessions WHERE session='s'").fetchone()
    covered = [b for m in memories for b in blocks if b.block_id in m.covered_block_ids]
    assert count == 6 and raw_bytes == sum(len(json.dumps(list(b.messages))) for b in covered)
    assert rows(replicas[2], "raw_blocks", "s") == 12


def test_a_session_state_is_kept_and_only_a_newer_one_replaces_it(make_store):
    store, other = make_store(), make_store()  # two replicas
    assert blocking(store).session_state("a") is None
    blocking(store).save_session_state("a", b"first", 10.0)
    blocking(other).save_session_state("a", b"older", 5.0)  # a late write of an older state
    assert blocking(other).session_state("a") == (b"first", 10.0)
    blocking(other).save_session_state("a", b"second", 20.0)
    assert blocking(store).session_state("a") == (b"second", 20.0)
    assert blocking(store).session_state("b") is None  # sessions are isolated
    commit(store, "a")  # a memory leaves the state alone, and the state the counts
    assert blocking(store).session_state("a") == (b"second", 20.0)
    assert store._execute("SELECT memories FROM sessions WHERE session='a'").fetchone()[0] == 1


def test_a_session_state_is_deleted_with_its_idle_session(make_store):
    store = make_store(StoreLimits(idle_s=100.0))
    blocking(store).save_session_state("old", b"state", 1.0)
    age(store, "old", 200)
    commit(store, "new")  # a commit runs retention
    assert blocking(store).session_state("old") is None


def test_a_memory_text_is_replaced_only_where_it_still_reads_what_it_did(make_store):
    """``replace_memory_text`` (a summary added after its compaction): the same
    id, blocks and embedding, only if the text is still the one the caller
    read; never another session's memory; an empty text is refused."""
    store = make_store()
    memory_id = commit(store, "s1")
    other = commit(store, "s2")
    sync = blocking(store)
    assert not sync.replace_memory_text("s1", memory_id, "another text", "new")  # reads otherwise
    assert not sync.replace_memory_text("s1", other, "summary of s2", "new")  # s2's memory, asked as s1
    assert sync.replace_memory_text("s1", memory_id, "summary of s1", "added\n\nsummary of s1")
    with pytest.raises(StoreError):
        sync.replace_memory_text("s1", memory_id, "added\n\nsummary of s1", "  ")
    [memory] = sync.load("s1").memories
    assert (memory.id, memory.summary) == (memory_id, "added\n\nsummary of s1")
    assert memory.covered_block_ids == tuple(b.block_id for b in BLOCKS[:2])
    assert np.array_equal(memory.embedding, VECTOR)
    assert [m.summary for m in sync.load("s2").memories] == ["summary of s2"]
