"""The replay's two APIs (``replay/wire.py``): one step's history sent as a
chat body or as Responses input items, and the answer read back the same way."""

from __future__ import annotations

import json

import pytest

from vllm_pamer.adapters.serving import responses_chat_messages, responses_request
from vllm_pamer.replay import wire
from vllm_pamer.replay.wire import answer_message, request_body, usage_of

HISTORY = [
    {"role": "system", "content": "You book flights."},
    {"role": "user", "content": "Cancel H9ZU1C."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "active"},
]
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]


def test_a_responses_step_is_the_same_history_as_vllm_reads_it():
    body = request_body("responses", "m", HISTORY, TOOLS, 8)
    assert body["store"] is False and body["max_output_tokens"] == 8
    assert body["tools"] == [{"type": "function", "name": "get", "parameters": {"type": "object"}}]
    read = responses_chat_messages(responses_request(body))
    assert [m["role"] for m in read] == ["system", "user", "assistant", "tool"]
    assert read[2]["tool_calls"][0]["id"] == "c1" and read[3]["content"] == "active"
    assert request_body("chat", "m", HISTORY, TOOLS, 8)["messages"] == HISTORY


def test_a_responses_answer_reads_as_a_chat_message_and_usage():
    data = {
        "output": [
            {"type": "message", "content": [{"type": "output_text", "text": "Let me check."}]},
            {"type": "function_call", "call_id": "c2", "name": "get", "arguments": '{"id": "H9ZU1C"}'},
        ],
        "usage": {"input_tokens": 100, "output_tokens": 8, "input_tokens_details": {"cached_tokens": 64}},
    }
    message = answer_message("responses", data)
    assert message["content"] == "Let me check."
    assert message["tool_calls"] == [{"id": "c2", "function": {"name": "get", "arguments": '{"id": "H9ZU1C"}'}}]
    assert usage_of("responses", data) == (100, 8, 64)
    chat = {"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
    assert answer_message("chat", chat) == {"content": "hi"} and usage_of("chat", chat) == (5, 1, None)


def _call(index, arguments, **fields):
    return {"choices": [{"delta": {"tool_calls": [{"index": index, "function": {"arguments": arguments}, **fields}]}}]}


def test_a_streamed_chat_answer_folds_into_the_body_a_plain_request_gets():
    """Content and tool-call deltas joined (calls by index), the usage and the
    plugin's report from the last chunks; the first token is the first delta
    with content or a call, not the role-only opening chunk; no answer
    before ``[DONE]``."""
    first_call = _call(0, '{"comm', id="c1", type="function")
    first_call["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] = "bash"
    second_call = _call(1, "{}", id="c2")
    second_call["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] = "cat"
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Look"}}]},
        {"choices": [{"index": 0, "delta": {"content": "ing."}}]},
        first_call,
        _call(0, 'and": "ls"}'),
        second_call,
        {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}},
        {"choices": [], "pamer": {"action": "none"}},
    ]
    answer = wire.StreamedChat()
    firsts = [answer.add(f"data: {json.dumps(c)}") for c in chunks]
    assert firsts == [False, True, False, False, False, False, False, False]
    with pytest.raises(ValueError, match="DONE"):
        answer.body()  # cut before [DONE]: no answer
    assert not answer.add("") and not answer.add("data: [DONE]")
    body = answer.body()
    assert wire.answer_message("chat", body) == {
        "role": "assistant",
        "content": "Looking.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
            {"id": "c2", "function": {"name": "cat", "arguments": "{}"}},
        ],
    }
    assert wire.usage_of("chat", body) == (10, 5, None) and body["pamer"] == {"action": "none"}
    assert wire.streamed({"model": "m"})["stream_options"] == {"include_usage": True}


def test_a_stream_that_ends_in_an_error_is_no_answer():
    answer = wire.StreamedChat()
    answer.add('data: {"choices": [{"delta": {"content": "Hi"}}]}')
    with pytest.raises(ValueError, match="overloaded"):
        answer.add('data: {"error": {"message": "overloaded", "code": 503}}')
