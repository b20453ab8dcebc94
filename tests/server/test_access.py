"""Who may use the plugin's routes and whose session a request names
(``server/access.py``): keys as vLLM checks them, tenants, session ids, and
the policies a request may name."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from vllm_pamer.adapters.serving import key_check
from vllm_pamer.server.access import Access, BadSessionId, Unauthorized, check_session_id, header_text
from vllm_pamer.server.input import session_header, session_id_of
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


def test_a_configured_header_names_the_session_after_x_session_id():
    from vllm_pamer.settings import Settings

    settings = Settings(session_headers="X-Conversation-Id, x-session-id ,")
    assert settings.session_header_names == ("x-session-id", "x-conversation-id")
    assert session_header({"x-conversation-id": "c1"}, settings) == "c1"
    assert session_header({"x-conversation-id": "c1", "x-session-id": "s1"}, settings) == "s1"  # X-Session-ID first
    assert session_header({"x-conversation-id": "c1"}, Settings()) is None  # not configured: not read


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
