"""Who may use the plugin's routes and whose session a request names
(``server/access.py``), and the chat route's body limits (``server/input.py``)."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.datastructures import Headers
from starlette.requests import Request

from vllm_pamer.adapters.serving import key_check
from vllm_pamer.server.access import Access, BadSessionId, Unauthorized, check_session_id, header_text
from vllm_pamer.server.input import MAX_DEPTH, InputError, read_body, session_id_of
from vllm_pamer.settings import Settings


def access(keys=("key-a", "key-b"), **settings) -> Access:
    return Access(list(keys), key_check(list(keys)), Settings(**settings))


def bearer(key: str) -> Headers:
    return Headers({"authorization": f"Bearer {key}"})


def test_a_request_needs_one_of_the_keys_as_vllm_checks_them():
    guard = access()
    for key in ("key-a", "key-b"):
        guard.authorize(bearer(key))
    for headers in (Headers({}), bearer("key-c"), Headers({"authorization": "key-a"}), bearer("key-a ")):
        with pytest.raises(Unauthorized):
            guard.authorize(headers)
    access(keys=()).authorize(Headers({}))  # a server without keys lets everyone in


def test_the_same_id_under_another_key_is_another_session():
    guard = access()
    a, b = guard.session_key(bearer("key-a"), "s1"), guard.session_key(bearer("key-b"), "s1")
    assert a != b and a.endswith("/s1") and b.endswith("/s1")
    assert guard.session_key(bearer("key-a"), "s1") == a
    assert access(keys=()).session_key(Headers({}), "s1") == "s1"  # one tenant: the id is the key


def test_a_tenant_header_names_the_tenant_when_configured():
    guard = access(keys=(), tenant_header="X-Tenant")
    one = guard.session_key(Headers({"x-tenant": "acme"}), "s1")
    assert one != guard.session_key(Headers({"x-tenant": "other"}), "s1")
    assert one == access(keys=("key-a",), tenant_header="X-Tenant").session_key(
        Headers({"x-tenant": "acme", "authorization": "Bearer key-a"}), "s1"
    )
    with pytest.raises(BadSessionId, match="x-tenant"):
        guard.session_key(Headers({}), "s1")


@pytest.mark.parametrize("bad", ["", "x" * 257, "\ud800", "a\nb", "tab\there", 7, None, ["s"]])
def test_a_bad_session_id_is_refused(bad):
    with pytest.raises(BadSessionId):
        check_session_id(bad)


def test_a_non_ascii_id_names_one_session_in_the_header_and_the_body():
    sent = "café-🙂"
    as_starlette_reads_it = sent.encode("utf-8").decode("latin-1")
    assert header_text(as_starlette_reads_it) == sent
    assert session_id_of(as_starlette_reads_it, None) == session_id_of(None, sent) == sent
    assert session_id_of(None, "") is None and session_id_of("", None) is None
    with pytest.raises(BadSessionId, match="UTF-8"):
        header_text(b"\xff\xfe".decode("latin-1"))


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


def test_a_request_names_only_an_allowed_policy():
    from vllm_pamer.server.access import PolicyRefused

    guard = access(keys=(), allowed_policies="none,recent_k,pamer")
    guard.check_policy("pamer", None)
    with pytest.raises(PolicyRefused, match="not allowed") as refused:
        guard.check_policy("pamer_plus", None)
    assert refused.value.status == 403
    with pytest.raises(PolicyRefused, match="keeps its policy") as switched:
        guard.check_policy("recent_k", "pamer")
    assert switched.value.status == 409
    access(keys=(), allowed_policies="*", policy_switch=True).check_policy("pamer_plus", "sam")


def test_the_default_allow_list_is_the_servers_policy_the_cheap_baselines_and_the_named_variants():
    default = Settings(policy="pamer", options_by_policy={"recent_10": {"policy": "recent_k", "k": 10}})
    assert default.client_policies == {"pamer", "none", "recent_k", "recent_10"}
    assert Settings(allowed_policies="*").client_policies is None
    assert Settings(allowed_policies="none, sam").client_policies == {"none", "sam"}
