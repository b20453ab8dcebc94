"""Held Responses API answers (``stores/responses.py``), on each backend: a
conversation stored a turn per row is read back whole and in order, never
with a gap, and goes with its session; a response id is held once."""

from __future__ import annotations

import time

import pytest

from tests.support.fakes import blocking
from vllm_pamer.core.store import StoreError, StoreLimits

SESSION = ("t/task-42", "task-42")


def turn(n):
    return [{"role": "user", "content": f"question {n}"}, {"role": "assistant", "content": f"answer {n}"}]


def hold_three(store):
    held = blocking(store)
    held.hold_response("t/r1", None, SESSION, turn(1), {"id": "r1"})
    held.hold_response("t/r2", "t/r1", SESSION, turn(2), {"id": "r2"})
    held.hold_response("t/r3", "t/r2", SESSION, turn(3), {"id": "r3", "output": [{"type": "message"}]})


def test_a_held_conversation_is_read_back_whole_from_any_of_its_answers(make_store):
    store = make_store()
    hold_three(store)
    last = blocking(store).held_response("t/r3")
    assert last.history == turn(1) + turn(2) + turn(3)
    assert last.response == {"id": "r3", "output": [{"type": "message"}]}
    assert (last.session, last.session_name) == SESSION
    assert blocking(store).held_response("t/r2").history == turn(1) + turn(2)
    assert blocking(store).held_response("other/r3") is None  # another tenant's key holds nothing


def test_a_conversation_with_a_lost_turn_is_not_read_back(make_store):
    store = make_store()
    hold_three(store)
    store._execute("DELETE FROM responses WHERE key='t/r1'")
    assert blocking(store).held_response("t/r3") is None  # never a history with a gap


def test_a_response_id_is_held_once(make_store):
    store = make_store()
    hold_three(store)
    with pytest.raises(StoreError):
        blocking(store).hold_response("t/r2", "t/r1", SESSION, turn(9), {"id": "r2"})
    assert blocking(store).held_response("t/r3").history == turn(1) + turn(2) + turn(3)


def test_held_responses_go_with_their_idle_session(make_store):
    store = make_store(StoreLimits(idle_s=60))
    hold_three(store)
    blocking(store).hold_response("t/x1", None, ("t/other", "other"), turn(1), {"id": "x1"})
    store._execute("UPDATE sessions SET last_used=0 WHERE session='t/task-42'")
    with store._lock, store._transaction():
        store._prune(time.time())
    assert blocking(store).held_response("t/r3") is None
    assert blocking(store).held_response("t/x1") is not None
