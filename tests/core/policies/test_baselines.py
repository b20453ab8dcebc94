"""The baseline policies that keep no memory (``core/policies/baselines.py``):
none, recent_k, sliding_window, discard_tool."""

from __future__ import annotations

import asyncio
import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.chat_strategies import conversations, join
from tests.support.fakes import blocks_of, lookup_chat, mixed_conversation, same_objects
from vllm_pamer.core.blocks import protocol_issues
from vllm_pamer.core.policies import PolicyRequest, create_policy
from vllm_pamer.core.policies.baselines import RecentK, SlidingWindow, _LastBlocks


def decide(name: str, messages: list[dict], **options):
    policy = create_policy(name, options)
    return asyncio.run(policy.rewrite(PolicyRequest(messages=messages, session_id="s1")))


def test_defaults():
    assert create_policy("sliding_window").config.k == 10
    assert create_policy("recent_k").config.k == 2
    assert create_policy("discard_tool").config.window == 2


@pytest.mark.parametrize("name, options", [("sliding_window", {"k": 0}), ("discard_tool", {"window": -1})])
def test_bad_options_are_rejected(name, options):
    with pytest.raises(ValueError):
        create_policy(name, options)


def test_sliding_window_is_recent_k_with_another_default():
    assert issubclass(SlidingWindow, _LastBlocks) and issubclass(RecentK, _LastBlocks)
    messages = lookup_chat(6)
    decision = decide("sliding_window", messages, k=3)
    assert decision.action == "rewritten" and decision.detail == "dropped 3 old blocks"
    assert decision.messages == messages[:2] + blocks_of(messages, 3)
    assert decide("recent_k", messages, k=3).messages == decision.messages


def test_sliding_window_with_few_blocks_sends_as_is():
    messages = lookup_chat(10)
    decision = decide("sliding_window", messages)
    assert decision.action == "none" and decision.messages == messages


def test_discard_tool_stubs_old_tool_outputs_only():
    messages = lookup_chat(4, chars=10)
    messages.insert(4, {"role": "user", "content": "keep me"})  # a user reply inside block 0
    snapshot = copy.deepcopy(messages)
    decision = decide("discard_tool", messages)
    assert decision.action == "rewritten" and decision.detail == "removed 2 old tool outputs"
    stub = {"role": "tool", "tool_call_id": "c0", "name": "lookup", "content": "[tool output removed: 14 chars]"}
    assert decision.messages[:5] == messages[:3] + [stub, messages[4]]
    assert decision.messages[5:7] == [messages[5], {**messages[6], "content": "[tool output removed: 14 chars]"}]
    assert all(a is b for a, b in zip(decision.messages[7:], messages[7:]))  # the last 2 blocks untouched
    assert len(decision.messages) == len(messages)
    assert protocol_issues(decision.messages) == []
    assert messages == snapshot  # the input was not mutated


def test_discard_tool_handles_function_results_and_window_zero():
    messages = [
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "calling"},
        {"role": "function", "name": "f", "content": [{"type": "text", "text": "abc"}]},
    ]
    decision = decide("discard_tool", messages, window=0)
    assert decision.messages[2] == {"role": "function", "name": "f", "content": "[tool output removed: 3 chars]"}


def test_discard_tool_without_old_tool_output_sends_as_is():
    messages = [{"role": "user", "content": "task"}] + [
        {"role": "assistant", "content": f"thought {i}"} for i in range(5)
    ]
    assert decide("discard_tool", messages).action == "none"
    assert decide("discard_tool", lookup_chat(2)).action == "none"
    empty = lookup_chat(3)
    empty[3]["content"] = ""
    assert decide("discard_tool", empty).action == "none"  # nothing to remove


@pytest.mark.parametrize("k", [1, 2, 3])
def test_recent_k_keeps_prefix_and_last_k_blocks(k):
    prefix, parts = mixed_conversation(6)
    messages = join(prefix, parts)
    decision = decide("recent_k", messages, k=k)
    expected = prefix + [m for block in parts[-k:] for m in block]
    assert decision.action == "rewritten"
    assert same_objects(decision.messages, expected)
    assert str(6 - k) in decision.detail


@pytest.mark.parametrize("n_blocks, k", [(0, 1), (1, 1), (2, 2), (3, 5)])
def test_recent_k_with_few_blocks_sends_as_is(n_blocks, k):
    messages = join(*mixed_conversation(n_blocks))
    decision = decide("recent_k", messages, k=k)
    assert decision.action == "none"
    assert same_objects(decision.messages, messages)


@given(conversations(), st.integers(min_value=1, max_value=5))
def test_recent_k_property(conv, k):
    prefix, parts = conv
    messages = join(prefix, parts)
    decision = decide("recent_k", messages, k=k)
    if len(parts) > k:
        assert decision.action == "rewritten"
        assert same_objects(decision.messages, prefix + [m for block in parts[-k:] for m in block])
    else:
        assert decision.action == "none"
        assert same_objects(decision.messages, messages)


def test_none_policy_sends_as_is():
    messages = join(*mixed_conversation(4))
    decision = decide("none", messages)
    assert decision.action == "none"
    assert same_objects(decision.messages, messages)
