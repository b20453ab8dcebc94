"""End to end: the memory on the APIs agents speak besides chat completions,
through the clients agents use, against a real ``vllm-pamer serve`` of the
default model: the Anthropic Messages API through the ``anthropic`` SDK
(whole answers and streams), on a shipped trajectory with a small context
budget."""

from __future__ import annotations

import pytest

from tests.support.anthropic_messages import to_anthropic
from tests.support.serve import TRAJECTORY
from vllm_pamer.core.blocks import protocol_issues
from vllm_pamer.default_model import DEFAULT_MODEL_NAME
from vllm_pamer.trajectories import agent_requests, load_trajectories

pytestmark = pytest.mark.e2e

STEPS = 16  # "pamer_budget" (tests/support/serve.py) compacts in these


@pytest.fixture(scope="module")
def trajectory():
    return {t["id"]: t for t in load_trajectories(kind="tau")}[TRAJECTORY]


def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def messages_run(compress_server, trajectory):
    """The trajectory's first requests through ``client.messages.create``, one session."""
    client = anthropic_client(compress_server)
    out = []
    for _, history in list(agent_requests(trajectory["messages"]))[:STEPS]:
        system, messages = to_anthropic(history)
        raw = client.messages.with_raw_response.create(
            model=DEFAULT_MODEL_NAME,
            system=system,
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_headers={"X-Session-ID": "messages-e2e", "X-Pamer-Policy": "pamer_budget", "X-Pamer-Echo": "1"},
        )
        out.append((raw.headers, raw.parse()))
    return out


def test_the_messages_api_gets_the_memory(messages_run):
    """Compaction and recall happen on Anthropic requests as on chat ones,
    the tool protocol of what the model reads stays whole, and the report is
    on the message and in the headers."""
    reports = [message.model_extra["pamer"] for _, message in messages_run]
    actions = [r["action"] for r in reports]
    assert "compressed" in actions and "recalled" in actions, actions
    for headers, message in messages_run:
        report = message.model_extra["pamer"]
        assert report["api"] == "messages" and report["session_id"] == "messages-e2e"
        assert headers["x-pamer-action"] == report["action"].split(" ", 1)[0]
        assert headers["x-pamer-policy"] == "pamer_budget"
        assert protocol_issues(report["messages_sent"]) == []
        assert message.type == "message" and message.role == "assistant"
    compacted = next(r for r in reports if r["action"] == "compressed")
    assert compacted["prompt_tokens_out"] < compacted["prompt_tokens_in"]


def test_a_streamed_message_carries_the_report(compress_server, trajectory):
    client = anthropic_client(compress_server)
    system, messages = to_anthropic(
        next(h for step, (_, h) in enumerate(agent_requests(trajectory["messages"])) if step == 3)
    )
    with client.messages.stream(
        model=DEFAULT_MODEL_NAME,
        system=system,
        messages=messages,
        max_tokens=8,
        extra_headers={"X-Session-ID": "messages-stream-e2e"},
    ) as stream:
        events = list(stream)
        headers = stream.response.headers
    deltas = [e for e in events if e.type == "message_delta"]
    assert deltas and deltas[-1].model_extra["pamer"]["session_id"] == "messages-stream-e2e"
    assert headers["x-pamer-session"] == "messages-stream-e2e"


def test_a_malformed_messages_request_is_refused_in_the_apis_own_terms(compress_server):
    """HTTP 400 with Anthropic's error body, before any memory operation."""
    import httpx

    response = httpx.post(
        f"{compress_server.base_url}/v1/messages",
        json={"model": DEFAULT_MODEL_NAME, "messages": "not a list", "max_tokens": 8},
        headers={"X-Session-ID": "messages-bad-e2e"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    session = httpx.get(f"{compress_server.base_url}/pamer/sessions/messages-bad-e2e", timeout=30)
    assert session.status_code == 404  # no session was made
