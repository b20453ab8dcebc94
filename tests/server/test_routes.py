"""The plugin's routes answered without an engine (``server/routes.py``)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from starlette.requests import Request

from vllm_pamer.core.store import LoadResult, StoreError
from vllm_pamer.server.routes import session_info
from vllm_pamer.settings import Settings


class _Store:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    async def load(self, key):
        if self.fail:
            raise StoreError("loading session memory failed: database is locked")
        return LoadResult([], 0)

    async def events(self, key, limit=200):
        return []


class _State:
    def __init__(self, fail: bool) -> None:
        self.settings = Settings()
        self.store = _Store(fail)
        self.access = SimpleNamespace(session_key=lambda headers, session_id: session_id)

    async def peek_session(self, key):
        return None


def _get(state: _State, session_id: str, query: str = ""):
    app = SimpleNamespace(state=SimpleNamespace(pamer=state))
    scope = {"type": "http", "app": app, "headers": [], "method": "GET", "path": "/", "query_string": query.encode()}
    response = asyncio.run(session_info(session_id, Request(scope)))
    return response.status_code, json.loads(response.body)


def test_a_store_fault_on_the_session_route_is_a_503_not_a_500():
    status, body = _get(_State(fail=True), "s1")
    assert status == 503
    assert body["error"]["type"] == "ServiceUnavailableError" and "database is locked" in body["error"]["message"]


def test_an_unknown_session_is_a_404():
    assert _get(_State(fail=False), "s1")[0] == 404


class _Kept(_State):
    """A session the server holds, with 150 events in its store."""

    def __init__(self) -> None:
        super().__init__(fail=False)
        self.asked: list[int] = []
        events = [{"time": float(i), "kind": "k", "detail": {}} for i in range(150)]

        async def read(key, limit=100):
            self.asked.append(limit)
            return events[-limit:]

        self.store.events = read

    async def peek_session(self, key):
        return SimpleNamespace(summary=lambda: {}, policy="none")

    def policies_made(self):
        return ()


def test_the_session_route_shows_the_newest_events_asked_for_up_to_what_the_store_keeps():
    state = _Kept()
    assert len(_get(state, "s1", "")[1]["events"]) == 100  # the default
    assert len(_get(state, "s1", "events=120")[1]["events"]) == 120
    _get(state, "s1", "events=999999999")
    assert state.asked[-1] == state.settings.store_limits.session_events  # no more than the store keeps
    for bad in ("0", "-1", "x", "1.5", "²", "9" * 5000):
        status, body = _get(state, "s1", f"events={bad}")
        assert status == 400 and "events must be" in body["error"]["message"], bad
