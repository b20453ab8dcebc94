"""A ``vllm-pamer serve`` of the default model with PaMER and every policy
selectable (the end-to-end tests' and the scaling scenarios'), and an agent's
chat request to it."""

from __future__ import annotations

from vllm_pamer.default_model import DEFAULT_MODEL_NAME
from vllm_pamer.server_process import ServerProcess


def chat(client, messages, session=None, policy=None, max_tokens=8, **kwargs):
    """One chat request as an agent sends it, asking the server to echo what it sent."""
    headers = {"X-Pamer-Echo": "1"}
    if session:
        headers["X-Session-ID"] = session
    if policy:
        headers["X-Pamer-Policy"] = policy
    return client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_headers=headers,
        **kwargs,
    )


TRAJECTORY = "airline-task2-trial1"  # 62 messages, 27 tool results, beyond the 8k window unrewritten
# Short internal answers keep a CPU replay fast; everything else is each policy's default.
# The server's own PaMER runs the paper's schedule; "pamer_budget" the budget schedule
# with a budget this trajectory reaches twice in BUDGET_STEPS requests.
PAMER_OPTIONS = {"summary_max_tokens": 48, "schedule": "paper"}
OPTIONS_BY_POLICY = {
    # the paper's text query (PaMER's default recalls with the captured state)
    "pamer_plus": {
        "summary_max_tokens": 48,
        "selector_max_tokens": 64,
        "recall_max_tokens": 48,
        "query_source": "text",
    },
    "periodic_summary": {"n": 4, "summary_max_tokens": 48},
    "rolling_summary": {"trigger_tokens": 1024, "summary_max_tokens": 48},
    "sam": {"trigger_tokens": 2500, "page_tokens": 1500, "cue_max_tokens": 48, "recall_max_tokens": 48},
    "sliding_window": {"k": 4},
    "pamer_conversation": {
        "policy": "pamer",
        "schedule": "paper",
        "summary_layout": "conversation",
        "summary_max_tokens": 48,
    },
    "pamer_budget": {
        "policy": "pamer",
        "context_budget": 4800,
        "band_share": 0.25,
        "target_share": 0.5,
        "summary_max_tokens": 48,
    },
    # the same, its summaries written after their compactions
    "pamer_after": {
        "policy": "pamer",
        "context_budget": 4800,
        "band_share": 0.25,
        "target_share": 0.5,
        "summary_max_tokens": 48,
        "summary_after": True,
    },
}


def start_pamer_server(heads, store_path, log_path, extra_args=(), port=None, env=None):
    """``vllm-pamer serve`` of the default model with PaMER as the default policy;
    ``store_path``: a SQLite file or a ``postgresql://`` URL."""
    import json

    server = ServerProcess(
        [
            "--pamer-policy",
            "pamer",
            "--pamer-policy-options",
            json.dumps(PAMER_OPTIONS),
            "--pamer-options-by-policy",
            json.dumps(OPTIONS_BY_POLICY),
            "--pamer-allowed-policies",  # the tests choose every policy by header
            "*",
            "--pamer-heads",
            str(heads),
            "--enforce-eager",
            "--enable-prompt-tokens-details",  # cached tokens per response
            *extra_args,
        ],
        port,
        log_path,
        env={"PAMER_STORE": str(store_path), **(env or {})},
    )
    try:
        server.wait_ready(timeout=600, progress=False)
    except Exception:
        server.stop()
        raise
    server.store_path = store_path
    return server


def client_for(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


HELD_HEADERS = {"X-Session-ID": "held-e2e", "X-Pamer-Echo": "1", "X-Pamer-Policy": "none"}
"""A held conversation's turns: policy none, so what a later turn sends is the held conversation as it is."""
HELD_BODY = {"session_id": "held-e2e", "pamer_echo": True, "pamer_policy": "none"}
"""The same in the body: vLLM's router forwards no custom header on ``/v1/responses``."""


def two_held_turns(client, extra_body=None):
    """Two turns of a Responses conversation the server holds (a function
    call and its output in the first); returns both answers."""
    from vllm_pamer.default_model import DEFAULT_MODEL_NAME

    first = client.responses.create(
        model=DEFAULT_MODEL_NAME,
        input=[
            {"role": "user", "content": "Cancel H9ZU1C."},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"id": "H9ZU1C"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "H9ZU1C: active, refundable"},
        ],
        max_output_tokens=8,
        extra_headers=HELD_HEADERS,
        extra_body=extra_body,
    )
    second = client.responses.create(
        model=DEFAULT_MODEL_NAME,
        previous_response_id=first.id,
        input="Go ahead.",
        max_output_tokens=8,
        extra_headers=HELD_HEADERS,
        extra_body=extra_body,
    )
    return first, second


def third_held_turn(client, second, headers=HELD_HEADERS, extra_body=None):
    """The turn after ``two_held_turns``, continuing from its second answer."""
    from vllm_pamer.default_model import DEFAULT_MODEL_NAME

    return client.responses.create(
        model=DEFAULT_MODEL_NAME,
        previous_response_id=second.id,
        input="Thanks.",
        max_output_tokens=8,
        extra_headers=headers,
        extra_body=extra_body,
    )


def assert_whole_conversation(third):
    """The third turn read every earlier item of the held conversation: the
    user turns, the function call and its output, the protocol whole."""
    from vllm_pamer.core.blocks import protocol_issues

    report = third.model_extra["pamer"]
    sent = report["messages_sent"]
    assert report["session_id"] == HELD_HEADERS["X-Session-ID"] and report["action"] == "none"
    assert [m["content"] for m in sent if m["role"] == "user"] == ["Cancel H9ZU1C.", "Go ahead.", "Thanks."]
    assert [c["id"] for m in sent for c in m.get("tool_calls") or []] == ["c1"]
    assert [m["content"] for m in sent if m["role"] == "tool"] == ["H9ZU1C: active, refundable"]
    assert protocol_issues(sent) == []
