"""What only the PostgreSQL store has (``stores/postgres.py``), on a throw-away
cluster (``pg_cluster`` in tests/conftest.py): a schema of another version
refused, not dropped; the previous schemas carried over; a lost connection
opened again; an unreachable store named without its password."""

from __future__ import annotations

import psycopg
import pytest

from tests.support.fakes import blocking
from tests.support.stores import BLOCKS, commit
from vllm_pamer.core.store import StoreError
from vllm_pamer.stores import open_store


def test_a_postgres_schema_of_another_version_is_refused_not_dropped(pg_cluster):
    url = pg_cluster.new_database()
    store = open_store(url)
    commit(store, "a")
    store._execute("UPDATE meta SET value='999' WHERE key='schema_version'")
    store.close()
    with pytest.raises(StoreError, match="schema version 999"):
        open_store(url)
    with psycopg.connect(url) as conn:  # nothing was dropped
        assert conn.execute("SELECT COUNT(*) FROM memories").fetchone()[0] == 1


def test_a_postgres_store_of_the_second_schema_is_carried_over(pg_cluster):
    url = pg_cluster.new_database()
    store = open_store(url)
    commit(store, "a")
    store._execute("ALTER TABLE sessions DROP COLUMN state, DROP COLUMN state_time")
    store._execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    store.close()
    reopened = open_store(url)
    assert len(blocking(reopened).load("a").memories) == 1
    blocking(reopened).save_session_state("a", b"state", 1.0)
    assert blocking(reopened).session_state("a") == (b"state", 1.0)
    reopened.close()


def test_a_postgres_store_of_the_third_schema_is_carried_over(pg_cluster):
    url = pg_cluster.new_database()
    store = open_store(url)
    commit(store, "a")
    store._execute("DROP TABLE responses")
    store._execute("UPDATE meta SET value='3' WHERE key='schema_version'")
    store.close()
    reopened = open_store(url)
    assert len(blocking(reopened).load("a").memories) == 1
    blocking(reopened).hold_response("r1", None, ("a", "a"), [{"role": "user", "content": "hi"}], {"id": "r1"})
    assert blocking(reopened).held_response("r1").history == [{"role": "user", "content": "hi"}]
    reopened.close()


def test_a_lost_postgres_connection_is_opened_again(pg_cluster):
    store = open_store(pg_cluster.new_database())
    commit(store, "a")
    with psycopg.connect(pg_cluster.url(), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (store._conn.info.backend_pid,))
    with pytest.raises(StoreError):  # the call that meets the loss fails: the request falls back
        blocking(store).load("a")
    assert len(blocking(store).load("a").memories) == 1  # the next one reconnects
    commit(store, "a", BLOCKS[2:4])
    store.close()


def test_an_unreachable_postgres_store_says_where(tmp_path):
    with pytest.raises(StoreError, match="cannot reach the PostgreSQL store at postgresql://nobody@") as error:
        open_store(f"postgresql://nobody:secret@/x?host={tmp_path}&port=1")
    assert "secret" not in str(error.value)
