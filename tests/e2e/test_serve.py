"""End to end: a real ``vllm-pamer serve`` of the embedded default model
(started once for this module, with two API keys: two tenants), driven
through the ``openai`` client with a real multi-turn agent trajectory."""

from __future__ import annotations

import json

import pytest
import requests

from tests.support.serve import chat
from vllm_pamer.core.blocks import protocol_issues
from vllm_pamer.default_model import DEFAULT_MODEL_NAME
from vllm_pamer.demo import ensure_demo_heads
from vllm_pamer.server_process import ServerProcess
from vllm_pamer.trajectories import agent_requests, load_trajectories

pytestmark = pytest.mark.e2e

TRAJECTORY = "airline-task14-trial1"  # 32 messages, fits the 8k window unrewritten
KEY, OTHER_KEY = "e2e-key-a", "e2e-key-b"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON_AUTH = {"Content-Type": "application/json", **AUTH}


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    heads = ensure_demo_heads(default_model_dir)
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = ServerProcess(
        ["--pamer-policy", "none", "--pamer-heads", str(heads), "--enforce-eager", "--max-num-seqs", "4"]
        + ["--api-key", KEY, OTHER_KEY],
        None,
        log,
        env={"PAMER_STORE": str(log.parent / "memory.sqlite3")},
    )
    try:
        proc.wait_ready(timeout=600, progress=False)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def trajectory():
    return {t["id"]: t for t in load_trajectories(kind="tau")}[TRAJECTORY]


@pytest.fixture(scope="module")
def replayed(client, trajectory):
    """The trajectory replayed twice, once per policy, each in its own session."""
    runs = {}
    for policy in ("none", "recent_k"):
        runs[policy] = [
            (history, chat(client, history, f"e2e-{policy}", policy))
            for _, history in agent_requests(trajectory["messages"])
        ]
    return runs


def test_every_response_reports_capture_and_five_logits(replayed):
    for policy, steps in replayed.items():
        assert len(steps) >= 10
        for _history, response in steps:
            report = response.model_extra["pamer"]
            assert report["policy"] == policy and report["session_id"] == f"e2e-{policy}"
            assert report["captured"] is True
            assert len(report["head_logits"]) == 5 and all(isinstance(v, float) for v in report["head_logits"])
            assert report["votes"] == sum(v > 0 for v in report["head_logits"])  # random heads: thresholds 0
            assert report["compress_vote"] == (report["votes"] >= 3)
            # our count of what was sent is the engine's own count
            assert report["prompt_tokens_out"] == response.usage.prompt_tokens


def test_none_sends_history_unchanged(replayed):
    for history, response in replayed["none"]:
        report = response.model_extra["pamer"]
        assert report["action"] == "none"
        assert report["messages_sent"] == history
        assert report["prompt_tokens_in"] == report["prompt_tokens_out"]


def test_recent_k_lowers_prompt_tokens_and_keeps_tool_pairs(replayed):
    none_tokens = [r.model_extra["pamer"]["prompt_tokens_out"] for _, r in replayed["none"]]
    rewritten = 0
    for (history, response), baseline in zip(replayed["recent_k"], none_tokens):
        report = response.model_extra["pamer"]
        sent = report["messages_sent"]
        assert report["prompt_tokens_in"] == baseline
        assert protocol_issues(sent) == []
        # every tool result still directly follows the block of its call
        for i, message in enumerate(sent):
            if message["role"] == "tool":
                opener = next(m for m in reversed(sent[:i]) if m["role"] == "assistant")
                assert message["tool_call_id"] in {c["id"] for c in opener.get("tool_calls") or []}
        if report["action"] == "rewritten":
            rewritten += 1
            assert report["prompt_tokens_out"] < report["prompt_tokens_in"]
            assert sent[:2] == history[:2]  # system prompt and task kept
            assert sent[-1] == history[-1]
    assert rewritten >= len(none_tokens) // 2


def test_session_endpoint_holds_last_vote(client, replayed, server):
    state = requests.get(f"{server.base_url}/pamer/sessions/e2e-none", headers=AUTH, timeout=10).json()
    assert state["captures"] == state["requests"] == len(replayed["none"])
    last = replayed["none"][-1][1].model_extra["pamer"]
    assert state["last_vote"]["head_logits"] == pytest.approx(last["head_logits"])
    assert requests.get(f"{server.base_url}/pamer/sessions/nope", headers=AUTH, timeout=10).status_code == 404


def test_streaming_last_chunk_carries_report(client, trajectory):
    history = next(h for i, h in agent_requests(trajectory["messages"]) if len(h) > 6)
    stream = chat(client, history, "e2e-stream", "recent_k", stream=True)
    chunks = list(stream)
    report = chunks[-1].model_extra["pamer"]
    assert report["captured"] is True and len(report["head_logits"]) == 5
    assert report["action"] == "rewritten"
    assert any(c.choices and c.choices[0].delta.content for c in chunks[:-1])


def test_request_without_session_is_served_unchanged(client, trajectory):
    history = trajectory["messages"][:6]
    response = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=history,
        max_tokens=4,
        temperature=0,
        extra_headers={"X-Pamer-Policy": "recent_k", "X-Pamer-Echo": "1"},
    )
    report = response.model_extra["pamer"]
    assert report["action"] == "fallback:missing_session_id"
    assert report["messages_sent"] == history


def test_orphan_tool_result_falls_back_unchanged(client, trajectory):
    history = trajectory["messages"][:2] + [{"role": "tool", "tool_call_id": "nope", "content": "stray"}]
    report = chat(client, history, "e2e-orphan", "recent_k").model_extra["pamer"]
    assert report["action"] == "fallback:unsafe_tool_protocol"
    assert report["messages_sent"] == history


@pytest.mark.parametrize(
    "body, needle",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"model": DEFAULT_MODEL_NAME, "messages": []}), "non-empty list"),
        (json.dumps({"model": DEFAULT_MODEL_NAME, "messages": [{"role": "robot", "content": "x"}]}), "robot"),
        (
            json.dumps(
                {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "pamer_policy": "nope"}
            ),
            "unknown memory policy",
        ),
        # refused before the policy sees the request, so no memory work starts
        (
            json.dumps(
                {
                    "model": DEFAULT_MODEL_NAME,
                    "messages": [{"role": "user", "content": "x"}],
                    "session_id": "e2e-bad-max-tokens",
                    "max_tokens": "many",
                }
            ),
            "max_tokens",
        ),
        (
            json.dumps(
                {
                    "model": DEFAULT_MODEL_NAME,
                    "messages": [{"role": "user", "content": "x"}],
                    "session_id": "e2e-bad-tools",
                    "tools": [{"type": "function", "function": {"description": "no name"}}],
                }
            ),
            "tools.0.function.name",
        ),
        (
            json.dumps(
                {
                    "model": DEFAULT_MODEL_NAME,
                    "messages": [{"role": "user", "content": "x"}],
                    "session_id": "e2e-bad-tool-choice",
                    "tool_choice": "required",
                }
            ),
            "`tools` must be set",
        ),
    ],
)
def test_malformed_requests_get_clear_400(server, body, needle):
    response = requests.post(f"{server.base_url}/v1/chat/completions", data=body, headers=JSON_AUTH, timeout=30)
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]
    session_id = json.loads(body).get("session_id") if needle != "not valid JSON" else None
    if session_id:  # refused before its session was touched
        answer = requests.get(f"{server.base_url}/pamer/sessions/{session_id}", headers=AUTH, timeout=10)
        assert answer.status_code == 404


def test_metrics_count_requests_by_action(server, replayed):
    text = requests.get(f"{server.base_url}/metrics", headers=AUTH, timeout=10).text
    assert 'vllm_pamer_requests_total{action="rewritten",policy="recent_k"}' in text
    assert "vllm_pamer_captures_total" in text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_plugin_routes_refuse_a_request_without_a_valid_key(server, replayed, headers):
    for method, path in (("get", "/pamer/sessions/e2e-none"), ("post", "/v1/chat/completions")):
        response = requests.request(method, server.base_url + path, headers=headers, json={}, timeout=10)
        assert response.status_code == 401, path
        assert "memories" not in response.text


def test_a_session_id_under_another_key_is_another_session(server, replayed, trajectory):
    other = {"Authorization": f"Bearer {OTHER_KEY}"}
    assert requests.get(f"{server.base_url}/pamer/sessions/e2e-recent_k", headers=other, timeout=10).status_code == 404
    history = trajectory["messages"][:4]
    body = {"model": DEFAULT_MODEL_NAME, "messages": history, "max_tokens": 2, "session_id": "e2e-recent_k"}
    response = requests.post(
        f"{server.base_url}/v1/chat/completions", json=body, headers={**other, "X-Pamer-Policy": "recent_k"}, timeout=60
    )
    assert response.status_code == 200 and response.json()["pamer"]["session_id"] == "e2e-recent_k"
    mine = requests.get(f"{server.base_url}/pamer/sessions/e2e-recent_k", headers=AUTH, timeout=10).json()
    theirs = requests.get(f"{server.base_url}/pamer/sessions/e2e-recent_k", headers=other, timeout=10).json()
    assert mine["requests"] == len(replayed["recent_k"]) and theirs["requests"] == 1


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ("[" * 2000 + "]" * 2000, 400, "nested"),
        (
            json.dumps({"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "x"}]}, indent=0).replace(
                '"x"', '"x"' + " " * (33 * 2**20)
            ),
            413,
            "limit",
        ),
        ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "session_id": "\\ud800"}', 400, "surrogate"),
    ],
)
def test_hostile_bodies_get_a_clear_4xx(server, body, status, needle):
    response = requests.post(f"{server.base_url}/v1/chat/completions", data=body, headers=JSON_AUTH, timeout=60)
    assert response.status_code == status
    assert needle in response.json()["error"]["message"]


def test_a_request_names_only_an_allowed_policy_and_a_session_keeps_its_own(server, replayed, trajectory):
    history = trajectory["messages"][:4]
    body = {"model": DEFAULT_MODEL_NAME, "messages": history, "max_tokens": 2}
    url = f"{server.base_url}/v1/chat/completions"
    costly = requests.post(url, json={**body, "session_id": "e2e-costly", "pamer_policy": "pamer_plus"}, headers=AUTH)
    assert costly.status_code == 403 and "not allowed" in costly.json()["error"]["message"]
    switch = requests.post(url, json={**body, "session_id": "e2e-none", "pamer_policy": "recent_k"}, headers=AUTH)
    assert switch.status_code == 409 and "keeps its policy" in switch.json()["error"]["message"]
    state = requests.get(f"{server.base_url}/pamer/sessions/e2e-none", headers=AUTH, timeout=10).json()
    assert state["policy"] == "none" and state["requests"] == len(replayed["none"])  # refused: not counted
    assert requests.get(f"{server.base_url}/pamer/sessions/e2e-costly", headers=AUTH, timeout=10).status_code == 404


def test_a_held_response_is_another_tenants_404(server, client):
    """A response the plugin holds (``previous_response_id``) is read and
    continued under the key that made it; under another key it does not
    exist; without a key the route refuses."""
    made = client.responses.create(
        model=DEFAULT_MODEL_NAME,
        input="My reservation is H9ZU1C.",
        max_output_tokens=4,
        extra_headers={"X-Session-ID": "held-tenant"},
    )
    url = f"{server.base_url}/v1/responses/{made.id}"
    assert requests.get(url, headers=AUTH, timeout=60).json()["id"] == made.id
    other = {"Authorization": f"Bearer {OTHER_KEY}"}
    assert requests.get(url, headers=other, timeout=60).status_code == 404
    assert requests.get(url, timeout=60).status_code == 401
    continued = requests.post(
        f"{server.base_url}/v1/responses",
        json={"model": DEFAULT_MODEL_NAME, "previous_response_id": made.id, "input": "And?", "max_output_tokens": 4},
        headers={**other, "X-Session-ID": "held-tenant"},
        timeout=120,
    )
    assert continued.status_code == 404 and "H9ZU1C" not in continued.text
    assert continued.headers["x-pamer-action"] == "fallback:unknown_conversation"
