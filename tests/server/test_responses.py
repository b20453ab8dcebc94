"""The Responses API's adapter (``server/responses.py``): the rewritten chat
view goes back to input items that vLLM's own conversion reads as that same
view, every tool call next to its result."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.chat_strategies import conversations, join
from vllm_pamer.adapters.serving import responses_chat_messages, responses_request
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.response_items import response_items
from vllm_pamer.server.access import BadSessionId
from vllm_pamer.server.responses import _chat_content, _chat_tools, named_session

MEMORY = {"role": "user", "content": "[memory 1] The user wants reservation H9ZU1C cancelled."}


def _as_chat(instructions, items):
    body = {"model": "m", "input": items, **({"instructions": instructions} if instructions else {})}
    return responses_chat_messages(responses_request(body))


def _stream(messages):
    """What a model reads of the messages, in order, whatever the message
    boundaries: texts by role, calls, results."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content)
        if m["role"] == "tool":
            out.append(("result", m.get("tool_call_id"), content or ""))
            continue
        if content:
            out.append((m["role"], content))
        for c in m.get("tool_calls") or []:
            out.append(("call", c["id"], c["function"]["name"], c["function"]["arguments"]))
    return out


CLIENT_INPUT = [
    {"role": "user", "content": "Cancel H9ZU1C."},
    {"type": "message", "role": "assistant", "content": "Checking."},
    {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"id": "H9ZU1C"}'},
    {"type": "function_call", "call_id": "c2", "name": "policy", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c2", "output": "refund in 5 days"},
    {"type": "function_call_output", "call_id": "c1", "output": "active"},
    {"role": "user", "content": [{"type": "input_text", "text": "Also, my email changed."}]},
]


def test_a_rewritten_view_goes_back_to_items_vllm_reads_as_the_same_view():
    view = _as_chat("You book flights.", CLIENT_INPUT)
    assert [m["role"] for m in view] == ["system", "user", "assistant", "tool", "tool", "user"]
    rewritten = view[:2] + [MEMORY] + view[2:]  # a memory after the prefix, as PaMER inserts it
    instructions, items = response_items(rewritten)
    assert instructions == "You book flights."
    back = _as_chat(instructions, items)
    assert back == [{k: v for k, v in m.items() if k != "type"} for m in rewritten]
    assert [i.get("type") for i in items[2:6]] == [None, "function_call", "function_call", "function_call_output"]


def test_the_chat_view_reads_responses_parts_as_chat_parts_and_function_tools_as_chat_tools():
    parts = [{"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": "data:image/png;base64,AA"}]
    assert _chat_content(parts) == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
    ]
    tools = [{"type": "function", "name": "get", "parameters": {"type": "object"}}, {"type": "web_search_preview"}]
    assert _chat_tools(tools) == [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    _, items = response_items([{"role": "user", "content": _chat_content(parts)}])
    assert items[0]["content"] == [
        {"type": "input_text", "text": "look"},
        {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "auto"},
    ]


@settings(max_examples=60, deadline=None)
@given(conversations(min_blocks=1), st.booleans())
def test_any_rewritten_view_survives_the_way_back(conversation, insert_memory):
    """A history rewritten as a policy does (the first block dropped, a memory
    after the prefix) goes back to items vLLM reads as the same text, calls
    and results in the same order: tool calls stay with their results."""
    prefix, parts = conversation
    view = join(prefix, parts)
    blocks = split_conversation(view)
    kept = [m for block in blocks.blocks[1:] for m in block.messages]
    rewritten = list(blocks.prefix) + ([MEMORY] if insert_memory else []) + kept
    back = _as_chat(*response_items(rewritten))
    assert protocol_issues(back) == protocol_issues(rewritten)
    assert _stream(back) == _stream(rewritten)


def test_the_session_is_the_header_else_session_id_else_the_conversation():
    body = {"session_id": "from-body", "conversation": "conv_1"}
    assert named_session("from-header", body) == "from-header"
    assert named_session(None, body) == "from-body"
    assert named_session(None, {"conversation": "conv_1"}) == "conv_1"
    assert named_session(None, {"conversation": {"id": "conv_2"}}) == "conv_2"
    assert named_session(None, {"input": "hi"}) is None  # the conversation's own, if it continues one
    with pytest.raises(BadSessionId):
        named_session(None, {"conversation": {"id": 7}})
