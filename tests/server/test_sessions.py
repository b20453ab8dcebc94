"""The server's per-session state (``server/sessions.py``)."""

from __future__ import annotations

from vllm_pamer.server.sessions import SessionRegistry, SessionState


def test_a_stored_session_state_replaces_only_an_older_one():
    registry = SessionRegistry()
    local = registry.touch("s")
    local.updated, local.captures = 10.0, 3
    older = SessionState("s", captures=1, updated=5.0)
    assert registry.touch("s", SessionState.decode(older.encode())).captures == 3  # a capture came meanwhile
    newer = SessionState("s", captures=7, updated=20.0)
    assert registry.touch("s", SessionState.decode(newer.encode())).captures == 7
    assert registry.touch("other", newer).session_id == "other"  # another session's state is never taken
