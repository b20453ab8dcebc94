"""The managed APIs' adapters (``server/apis.py``): the rewritten chat view
goes back to an Anthropic body that vLLM's own conversion reads as that
same view, with every tool call next to its result."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.anthropic_messages import to_anthropic
from tests.support.chat_strategies import conversations, join
from vllm_pamer.adapters.serving import anthropic_chat_request
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.server.apis import anthropic_turns


class _Messages:
    """vLLM's Anthropic handler as far as the conversion reads it (no engine)."""

    _merge_inline_system = False

    def __init__(self) -> None:
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        self.to_chat_completion_request = AnthropicServingMessages.to_chat_completion_request


def _as_chat(system, turns):
    body = {"model": "m", "max_tokens": 8, "messages": turns, **({"system": system} if system else {})}
    return anthropic_chat_request(body, _Messages()).model_dump(exclude_unset=True)["messages"]


def _plain(messages):
    """The fields the pipeline reads, as comparable dicts."""
    out = []
    for m in messages:
        calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content)
        out.append((m["role"], content or "", calls, m.get("tool_call_id")))
    return out


MEMORY = {"role": "user", "content": "[memory 1] The user wants reservation H9ZU1C cancelled."}


def test_a_rewritten_view_goes_back_to_turns_vllm_reads_as_the_same_view():
    anthropic = [
        {"role": "user", "content": "Cancel H9ZU1C."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get", "input": {"id": "H9ZU1C"}},
                {"type": "tool_use", "id": "t2", "name": "policy", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "active"},
                {"type": "tool_result", "tool_use_id": "t2", "content": "refund in 5 days"},
                {"type": "text", "text": "Also, my email changed."},
            ],
        },
    ]
    view = _as_chat("You book flights.", anthropic)
    rewritten = view[:2] + [MEMORY] + view[2:]  # a memory after the prefix, as PaMER inserts it
    system, turns = anthropic_turns(rewritten)
    assert system == "You book flights."
    assert _plain(_as_chat(system, turns)) == _plain(rewritten)
    assert [t["role"] for t in turns] == ["user", "user", "assistant", "user", "user"]
    assert [b["type"] for b in turns[3]["content"]] == ["tool_result", "tool_result"]  # both results in one turn


@settings(max_examples=60, deadline=None)
@given(conversations(min_blocks=1), st.booleans())
def test_any_rewritten_view_survives_the_way_back(conversation, insert_memory):
    """An Anthropic client's history as vLLM reads it, rewritten as a policy
    does (the first block dropped, a memory after the prefix), goes back to
    turns that vLLM reads as the same messages: tool calls stay with their
    results, nothing is lost or reordered."""
    prefix, parts = conversation
    for block in parts:  # a client's tool input is an object
        for call in block[0].get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps({"q": call["function"]["arguments"]})
    view = _as_chat(*to_anthropic(join(prefix, parts)))
    blocks = split_conversation(view)
    kept = [m for block in blocks.blocks[1:] for m in block.messages]
    rewritten = list(blocks.prefix) + ([MEMORY] if insert_memory else []) + kept
    back = _as_chat(*anthropic_turns(rewritten))
    assert protocol_issues(back) == protocol_issues(rewritten)
    assert _plain(back) == _plain(rewritten)
