"""The chat route's checks of what a request carries (``server/input.py``): the
body's size and depth limits, and the plugin's own request fields."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from vllm_pamer.server.input import MAX_DEPTH, InputError, context_budget_of, read_body


@pytest.mark.parametrize(
    "header, field, want",
    [(None, None, None), ("4096", None, 4096), (None, 3000, 3000), ("2048", 9999, 2048), (None, "1500", 1500)],
)
def test_the_context_budget_comes_from_the_header_or_the_body(header, field, want):
    assert context_budget_of(header, field) == want


@pytest.mark.parametrize(
    "header, field", [("0", None), ("-5", None), ("lots", None), (None, 2.5), (None, True), (None, [4096]), ("", None)]
)
def test_a_bad_context_budget_is_a_clear_400(header, field):
    with pytest.raises(InputError, match="positive number of tokens") as error:
        context_budget_of(header, field)
    assert error.value.status == 400


def request_with(body: bytes, declared: int | None = None, chunk: int = 1 << 16) -> Request:
    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive():
        return messages.pop(0)

    length = len(body) if declared is None else declared
    headers = [(b"content-length", str(length).encode())] if declared != -1 else []
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


def read(body: bytes, limit: int = 1 << 20, declared: int | None = None) -> dict:
    return asyncio.run(read_body(request_with(body, declared), limit))


def test_a_body_over_the_limit_is_a_413_declared_or_streamed():
    ok = json.dumps({"messages": [{"role": "user", "content": "x" * 100}]}).encode()
    assert read(ok, limit=len(ok))["messages"][0]["content"] == "x" * 100
    for declared in (None, -1):  # by its Content-Length, and by what arrives without one
        with pytest.raises(InputError, match="limit") as error:
            read(ok, limit=len(ok) - 1, declared=declared)
        assert error.value.status == 413


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5_000])
def test_a_body_nested_too_deeply_is_a_400(depth):
    body = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(InputError, match="nested") as error:
        read(body)
    assert error.value.status == 400
    shallow = b'{"messages": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert read(shallow)["messages"]
