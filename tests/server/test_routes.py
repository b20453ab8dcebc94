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


def _get(state: _State, session_id: str):
    app = SimpleNamespace(state=SimpleNamespace(pamer=state))
    request = Request({"type": "http", "app": app, "headers": [], "method": "GET", "path": "/"})
    response = asyncio.run(session_info(session_id, request))
    return response.status_code, json.loads(response.body)


def test_a_store_fault_on_the_session_route_is_a_503_not_a_500():
    status, body = _get(_State(fail=True), "s1")
    assert status == 503
    assert body["error"]["type"] == "ServiceUnavailableError" and "database is locked" in body["error"]["message"]


def test_an_unknown_session_is_a_404():
    assert _get(_State(fail=False), "s1")[0] == 404
