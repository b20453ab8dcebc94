"""A session id on a route the plugin does not manage is never silent
(``server/unmanaged.py``): the answer says so in a header, the metric counts
it, a warning is logged once per route; managed routes and requests without
a session are left alone."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from vllm_pamer.server import metrics
from vllm_pamer.server.unmanaged import UnmanagedSessionNotice, mark_managed


def _app() -> TestClient:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> dict:
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat() -> dict:
        return {"ok": True}

    @app.post("/v1/whatever")
    async def streamed() -> StreamingResponse:
        async def chunks():
            yield "data: 1\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/invocations")
    async def invocations(request: Request) -> dict:
        body = await request.json()
        if "messages" in body:  # as the plugin's /invocations: chat bodies are managed
            mark_managed(request.scope)
        return {"ok": True}

    app.add_middleware(UnmanagedSessionNotice, managed=["/v1/chat/completions", "/v1/messages"])
    return TestClient(app)


def _count(route: str) -> float:
    return metrics.UNMANAGED_REQUESTS.labels(route)._value.get()


def test_a_session_on_an_unmanaged_route_is_said_in_a_header_a_metric_and_one_warning(caplog):
    client = _app()
    before, other = _count("/v1/completions"), _count("other")
    with caplog.at_level(logging.WARNING, logger="vllm_pamer.server"):
        first = client.post("/v1/completions", headers={"X-Session-ID": "s1"})
        client.post("/v1/completions", headers={"X-Session-ID": "s1"})
        streamed = client.post("/v1/whatever", headers={"X-Session-ID": "s1"})
    assert first.json() == {"ok": True}  # served as vLLM serves it
    assert first.headers["x-pamer-memory"].startswith("not applied: /v1/completions")
    assert "/v1/chat/completions" in first.headers["x-pamer-memory"]
    assert streamed.text == "data: 1\n\n" and "x-pamer-memory" in streamed.headers
    assert _count("/v1/completions") == before + 2 and _count("other") == other + 1  # any other path: one label
    assert len([r for r in caplog.records if "/v1/completions" in r.getMessage()]) == 1


def test_managed_routes_and_requests_without_a_session_get_no_notice():
    client = _app()
    assert "x-pamer-memory" not in client.post("/v1/chat/completions", headers={"X-Session-ID": "s"}).headers
    assert "x-pamer-memory" not in client.post("/v1/completions").headers


def test_a_route_that_manages_some_bodies_marks_them_and_only_the_others_get_the_notice():
    client = _app()
    before = _count("/invocations")
    chat = client.post("/invocations", json={"messages": []}, headers={"X-Session-ID": "s"})
    completion = client.post("/invocations", json={"prompt": "hi"}, headers={"X-Session-ID": "s"})
    assert "x-pamer-memory" not in chat.headers
    assert completion.headers["x-pamer-memory"].startswith("not applied: /invocations")
    assert _count("/invocations") == before + 1


def test_a_configured_session_header_gets_the_notice_too():
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> dict:
        return {"ok": True}

    app.add_middleware(UnmanagedSessionNotice, managed=[], session_headers=["x-session-id", "x-conversation-id"])
    answer = TestClient(app).post("/v1/completions", headers={"X-Conversation-Id": "c1"})
    assert answer.headers["x-pamer-memory"].startswith("not applied: /v1/completions")
