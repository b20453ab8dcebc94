"""What only the SQLite store has (``stores/sqlite.py``): a corrupt file set
aside, a schema of another version treated as corrupt."""

from __future__ import annotations

import asyncio
import sqlite3

from tests.support.fakes import COMPRESS, FakeEngine, conversation
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, create_policy
from vllm_pamer.stores.sqlite import SqliteStore


def test_corrupt_database_file_starts_empty(tmp_path):
    path = tmp_path / "memory.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    store = SqliteStore(path)
    assert store.reset_events and list(tmp_path.glob("memory.sqlite3.corrupt-*"))
    policy = create_policy("pamer", {"schedule": "paper"})  # the emptied store takes a compression
    outcome = asyncio.run(rewrite_request(conversation(8), "s1", policy, COMPRESS, PolicyContext(store, FakeEngine())))
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
