"""End to end: the memory on the APIs agents speak besides chat completions,
through the clients agents use, against a real ``vllm-pamer serve`` of the
default model: the Anthropic Messages API through the ``anthropic`` SDK and
the Responses API through the ``openai`` SDK (whole answers, streams, and
conversations the server holds for ``previous_response_id``), and the chat
and Responses bodies of SageMaker's ``/invocations``, on a shipped trajectory
with a small context budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.support.anthropic_messages import to_anthropic
from tests.support.serve import (
    TRAJECTORY,
    assert_whole_conversation,
    start_pamer_server,
    third_held_turn,
    two_held_turns,
)
from vllm_pamer.core.blocks import protocol_issues
from vllm_pamer.core.response_items import response_items
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
            extra_headers={"X-Session-ID": "messages-e2e", "X-Pamer-Policy": "pamer_budget", "X-Pamer-Echo": "1"},
        )
        out.append((raw.headers, raw.parse()))
    return out


def _memory_worked(run, api, session):
    """Compaction and recall happen on the API's requests as on chat ones,
    the tool protocol of what the model reads stays whole, and the report is
    on the answer and in the headers."""
    reports = [answer.model_extra["pamer"] for _, answer in run]
    actions = [r["action"] for r in reports]
    assert "compressed" in actions and "recalled" in actions, actions
    for (headers, _), report in zip(run, reports, strict=True):
        assert report["api"] == api and report["session_id"] == session
        assert headers["x-pamer-action"] == report["action"].split(" ", 1)[0]
        assert headers["x-pamer-policy"] == "pamer_budget"
        assert protocol_issues(report["messages_sent"]) == []
    compacted = next(r for r in reports if r["action"] == "compressed")
    assert compacted["prompt_tokens_out"] < compacted["prompt_tokens_in"]


def test_the_messages_api_gets_the_memory(messages_run):
    _memory_worked(messages_run, "messages", "messages-e2e")
    assert all(m.type == "message" and m.role == "assistant" for _, m in messages_run)


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


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def responses_run(compress_server, trajectory):
    """The trajectory's first requests through ``client.responses.create``,
    each with its whole history (stateless), one session."""
    client = openai_client(compress_server)
    out = []
    for _, history in list(agent_requests(trajectory["messages"]))[:STEPS]:
        instructions, items = response_items(history)
        raw = client.responses.with_raw_response.create(
            model=DEFAULT_MODEL_NAME,
            instructions=instructions,
            input=items,
            max_output_tokens=8,
            temperature=0,
            store=False,
            extra_headers={"X-Session-ID": "responses-e2e", "X-Pamer-Policy": "pamer_budget", "X-Pamer-Echo": "1"},
        )
        out.append((raw.headers, raw.parse()))
    return out


def test_the_responses_api_gets_the_memory(responses_run):
    _memory_worked(responses_run, "responses", "responses-e2e")
    assert all(r.object == "response" and r.status in ("completed", "incomplete") for _, r in responses_run)


@pytest.fixture(scope="module")
def held_run(compress_server, trajectory):
    """The trajectory's first requests as one conversation the server holds:
    after the first, each turn sends its instructions, ``previous_response_id``
    and only what came after the previous turn's history (the recorded action
    and its results, the user's next turn); the plugin holds the rest, the
    model's own answers included."""
    client = openai_client(compress_server)
    out, previous, seen = [], None, 0
    for _, history in list(agent_requests(trajectory["messages"]))[:STEPS]:
        instructions, items = response_items(history[seen:] if previous else history)
        if previous:
            instructions = response_items(history)[0]  # instructions do not carry over: an agent sends them each turn
        raw = client.responses.with_raw_response.create(
            model=DEFAULT_MODEL_NAME,
            instructions=instructions,
            input=items,
            previous_response_id=previous,
            max_output_tokens=8,
            temperature=0,
            extra_headers={"X-Session-ID": "held-chain-e2e", "X-Pamer-Policy": "pamer_budget", "X-Pamer-Echo": "1"},
        )
        answer = raw.parse()
        out.append((raw.headers, answer))
        previous, seen = answer.id, len(history)
    return out


def test_a_held_conversation_gets_the_memory(held_run):
    """The held conversation grows by what each turn adds and the model's
    answers, and PaMER keeps what the model reads within the budget."""
    _memory_worked(held_run, "responses", "held-chain-e2e")
    last = held_run[-1][1].model_extra["pamer"]
    assert last["prompt_tokens_in"] > held_run[0][1].model_extra["pamer"]["prompt_tokens_in"]


def test_a_conversation_the_server_holds_continues_from_the_last_response(compress_server):
    """``previous_response_id``: the plugin holds each answer with the turn
    that asked for it and continues the conversation (the model reads every
    earlier turn and answer), ``GET /v1/responses/{id}`` answers a held
    response, and an id the plugin does not hold goes to vLLM as sent: here
    vLLM's 404 (its own store is off), marked in the header."""
    import httpx
    import openai

    client = openai_client(compress_server)
    headers = {"X-Session-ID": "held-e2e", "X-Pamer-Echo": "1", "X-Pamer-Policy": "recent_k"}
    first = client.responses.create(
        model=DEFAULT_MODEL_NAME,
        instructions="You are a travel agent.",
        input="My reservation is H9ZU1C.",
        max_output_tokens=8,
        extra_headers=headers,
    )
    second = client.responses.create(
        model=DEFAULT_MODEL_NAME,
        previous_response_id=first.id,
        input="Please cancel it.",
        max_output_tokens=8,
        extra_headers=headers,
    )
    third = client.responses.create(
        model=DEFAULT_MODEL_NAME,
        previous_response_id=second.id,
        input=[{"role": "user", "content": "Thanks."}],
        max_output_tokens=8,
        extra_headers={"X-Pamer-Echo": "1", "X-Pamer-Policy": "recent_k"},  # the session is the conversation's
    )
    report = third.model_extra["pamer"]
    sent = report["messages_sent"]
    assert report["session_id"] == "held-e2e"
    assert [m["content"] for m in sent if m["role"] == "user"] == [
        "My reservation is H9ZU1C.",
        "Please cancel it.",
        "Thanks.",
    ]
    assert [m["role"] for m in sent].count("assistant") == 2  # the model's two answers, held
    assert not any(m["role"] == "system" for m in sent)  # instructions do not carry over
    fetched = httpx.get(f"{compress_server.base_url}/v1/responses/{second.id}", timeout=60)
    assert fetched.status_code == 200 and fetched.json()["id"] == second.id
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.with_raw_response.create(
            model=DEFAULT_MODEL_NAME,
            previous_response_id="resp_never_made",
            input="What is my reservation?",
            max_output_tokens=8,
            extra_headers=headers,
        )
    assert refused.value.response.headers["x-pamer-action"] == "fallback:unknown_conversation"


def test_a_streamed_response_carries_the_report(compress_server, trajectory):
    client = openai_client(compress_server)
    history = next(h for step, (_, h) in enumerate(agent_requests(trajectory["messages"])) if step == 3)
    instructions, items = response_items(history)
    with client.responses.stream(
        model=DEFAULT_MODEL_NAME,
        instructions=instructions,
        input=items,
        max_output_tokens=8,
        extra_headers={"X-Session-ID": "responses-stream-e2e"},
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed"
    assert final.model_extra["pamer"]["session_id"] == "responses-stream-e2e"
    assert final.model_extra["pamer"]["api"] == "responses"


def test_a_malformed_responses_request_is_refused_before_any_memory_operation(compress_server):
    import httpx

    response = httpx.post(
        f"{compress_server.base_url}/v1/responses",
        json={"model": DEFAULT_MODEL_NAME, "input": 5},
        headers={"X-Session-ID": "responses-bad-e2e"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "BadRequestError"
    session = httpx.get(f"{compress_server.base_url}/pamer/sessions/responses-bad-e2e", timeout=30)
    assert session.status_code == 404


@pytest.fixture(scope="module")
def invocations_run(compress_server, trajectory):
    """The trajectory's first requests as chat bodies on ``/invocations``,
    the session in the body (SageMaker passes no custom header)."""
    import httpx

    out = []
    for _, history in list(agent_requests(trajectory["messages"]))[:STEPS]:
        body = {"model": DEFAULT_MODEL_NAME, "messages": history, "max_tokens": 8, "session_id": "invocations-e2e"}
        body.update(pamer_policy="pamer_budget", pamer_echo=True)
        response = httpx.post(f"{compress_server.base_url}/invocations", json=body, timeout=300)
        assert response.status_code == 200, response.text
        out.append((response.headers, SimpleNamespace(model_extra=response.json())))
    return out


def test_invocations_manages_chat_bodies(invocations_run):
    _memory_worked(invocations_run, "chat", "invocations-e2e")
    assert all("x-pamer-memory" not in headers for headers, _ in invocations_run)


def test_invocations_manages_responses_bodies_and_passes_the_others_to_vllm(compress_server, trajectory):
    """A Responses body on ``/invocations`` gets the memory as on
    ``/v1/responses``; a completion body is served by vLLM as sent, and says
    the memory was not applied."""
    import httpx

    history = next(h for step, (_, h) in enumerate(agent_requests(trajectory["messages"])) if step == 3)
    instructions, items = response_items(history)
    url = f"{compress_server.base_url}/invocations"
    response = httpx.post(
        url,
        json={"model": DEFAULT_MODEL_NAME, "instructions": instructions, "input": items, "max_output_tokens": 8},
        headers={"X-Session-ID": "invocations-responses-e2e", "X-Pamer-Echo": "1"},
        timeout=300,
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "response" and answer["pamer"]["api"] == "responses"
    assert answer["pamer"]["session_id"] == "invocations-responses-e2e"
    assert protocol_issues(answer["pamer"]["messages_sent"]) == []
    completion = httpx.post(
        url,
        json={"model": DEFAULT_MODEL_NAME, "prompt": "Hello", "max_tokens": 4},
        headers={"X-Session-ID": "invocations-e2e"},
        timeout=300,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["object"] == "text_completion" and "pamer" not in completion.json()
    assert completion.headers["x-pamer-memory"].startswith("not applied: /invocations")


def test_a_held_conversation_survives_a_crash_of_the_server(compress_heads, tmp_path):
    """The server is killed (SIGKILL) after two turns and started again on
    the same SQLite store: the third turn continues from the second answer
    with every earlier item, a function call and its output included."""
    store = tmp_path / "memory.sqlite3"
    server = start_pamer_server(compress_heads, store, tmp_path / "first.log")
    try:
        _, second = two_held_turns(openai_client(server))
    finally:
        server.kill()
    server = start_pamer_server(compress_heads, store, tmp_path / "second.log")
    try:  # no session named: the session is the conversation's
        third = third_held_turn(openai_client(server), second, {"X-Pamer-Echo": "1", "X-Pamer-Policy": "none"})
    finally:
        server.stop()
    assert_whole_conversation(third)
