"""The ``pamer`` policy (``core/policies/pamer/policy.py``): the session's
memories as the store loads them, corrupt ones discarded and said so."""

from __future__ import annotations

import asyncio

from tests.support.fakes import COMPRESS, KEEP, FakeEngine, blocking, conversation
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, PolicyRequest, create_policy


def test_corrupt_rows_are_discarded_not_repaired(store):
    policy = create_policy("pamer", {"schedule": "paper"})
    run = lambda messages, vote: asyncio.run(
        rewrite_request(
            policy,
            PolicyRequest(
                messages=messages, session_id="s1", previous_vote=vote, context=PolicyContext(store, FakeEngine())
            ),
        )
    )
    run(conversation(8), COMPRESS)
    store._conn.execute("UPDATE memories SET embedding = x'00'")
    outcome = run(conversation(10), KEEP)
    assert outcome.action == "none" and "discarded 1 corrupt" in outcome.detail
    assert outcome.messages == conversation(10)  # no memory, so no block is dropped
    assert blocking(store).load("s1").memories == []
    assert store._conn.execute("SELECT COUNT(*) FROM raw_blocks").fetchone()[0] == 0
