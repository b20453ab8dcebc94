"""Policy registry, the baseline policies and the pipeline's fallback rules."""

from __future__ import annotations

import asyncio
import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.chat_strategies import conversations, join
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import (
    HeadVote,
    MemoryPolicy,
    PolicyDecision,
    PolicyRequest,
    UnknownPolicy,
    available_policies,
    create_policy,
    policy_class,
    register_policy,
)
from vllm_pamer.core.policies.baselines import PassThrough, RecentK

# --- test-only policies (module level: registered once per test session) -----


@register_policy
class _Raises(MemoryPolicy):
    name = "test_raises"

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        raise RuntimeError("boom")


@register_policy
class _DropsToolResult(MemoryPolicy):
    """Returns the conversation without its last tool result (protocol broken)."""

    name = "test_drops_tool_result"

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        messages = request.conversation.messages()
        last_tool = max(i for i, m in enumerate(messages) if m["role"] == "tool")
        return PolicyDecision(messages[:last_tool] + messages[last_tool + 1 :], "rewritten")


@register_policy
class _Empty(MemoryPolicy):
    name = "test_empty"

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        return PolicyDecision([], "rewritten")


@register_policy
class _SelfFallback(MemoryPolicy):
    """Returns different messages but declares a fallback: the pipeline must
    send the originals."""

    name = "test_self_fallback"

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        return PolicyDecision.fallback(list(request.conversation.prefix), Fallback.SUMMARY_FAILURE, "summary failed")


@register_policy
class _Records(MemoryPolicy):
    name = "test_records"
    seen: list[PolicyRequest] = []

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        type(self).seen.append(request)
        return PolicyDecision(request.conversation.messages(), "none")


def run(coro):
    return asyncio.run(coro)


def _call(call_id: str, name: str = "read") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": '{"p": 1}'}}


def _conversation(n_blocks: int) -> tuple[list[dict], list[list[dict]]]:
    """A fixed conversation: system + task, then ``n_blocks`` blocks that
    alternate tool-calling and plain-text assistants."""
    prefix = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    parts = []
    for b in range(n_blocks):
        if b % 2 == 0:
            ids = [f"c{b}a", f"c{b}b"]
            parts.append(
                [
                    {"role": "assistant", "content": None, "tool_calls": [_call(i) for i in ids]},
                    {"role": "tool", "tool_call_id": ids[1], "content": f"r{b}b"},
                    {"role": "tool", "tool_call_id": ids[0], "content": f"r{b}a"},
                ]
            )
        else:
            parts.append([{"role": "assistant", "content": f"thinking {b}"}, {"role": "user", "content": f"go {b}"}])
    return prefix, parts


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


# --- registry ----------------------------------------------------------------


def test_registry_lists_the_baselines():
    names = available_policies()
    assert "none" in names and "recent_k" in names
    assert names == sorted(names)
    assert policy_class("none") is PassThrough
    assert policy_class("recent_k") is RecentK


def test_unknown_policy_names_the_available_ones():
    with pytest.raises(UnknownPolicy) as info:
        create_policy("no_such_policy")
    message = str(info.value)
    assert "no_such_policy" in message
    for name in available_policies():
        assert name in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnknownPolicy):
        policy_class("no_such_policy")


def test_create_policy_validates_options():
    assert create_policy("recent_k").config.k == 2
    assert create_policy("recent_k", {"k": 5}).config.k == 5
    assert isinstance(create_policy("none"), PassThrough)


@pytest.mark.parametrize(
    "name, options",
    [
        ("recent_k", {"k": 0}),
        ("recent_k", {"k": -3}),
        ("recent_k", {"k": "two"}),
        ("recent_k", {"n": 2}),
        ("recent_k", {"k": 2, "extra": True}),
        ("none", {"k": 1}),
    ],
)
def test_create_policy_rejects_bad_options(name, options):
    with pytest.raises(ValueError):
        create_policy(name, options)


def test_register_policy_refuses_a_second_class_under_a_taken_name():
    class Impostor(MemoryPolicy):
        name = "recent_k"

        async def rewrite(self, request):  # pragma: no cover - never called
            raise AssertionError

    with pytest.raises(ValueError, match="already registered"):
        register_policy(Impostor)
    assert policy_class("recent_k") is RecentK
    assert register_policy(RecentK) is RecentK  # re-registering the same class is fine


# --- baseline policies -------------------------------------------------------


def _policy_request(messages, session_id="s1"):
    return PolicyRequest(session_id, split_conversation(messages))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_recent_k_keeps_prefix_and_last_k_blocks(k):
    prefix, parts = _conversation(6)
    messages = join(prefix, parts)
    decision = run(create_policy("recent_k", {"k": k}).rewrite(_policy_request(messages)))
    expected = prefix + [m for block in parts[-k:] for m in block]
    assert decision.action == "rewritten"
    assert _same_objects(decision.messages, expected)
    assert str(6 - k) in decision.detail


@pytest.mark.parametrize("n_blocks, k", [(0, 1), (1, 1), (2, 2), (3, 5)])
def test_recent_k_with_few_blocks_sends_as_is(n_blocks, k):
    messages = join(*_conversation(n_blocks))
    decision = run(create_policy("recent_k", {"k": k}).rewrite(_policy_request(messages)))
    assert decision.action == "none"
    assert _same_objects(decision.messages, messages)


@given(conversations(), st.integers(min_value=1, max_value=5))
def test_recent_k_property(conv, k):
    prefix, parts = conv
    messages = join(prefix, parts)
    decision = run(create_policy("recent_k", {"k": k}).rewrite(_policy_request(messages)))
    if len(parts) > k:
        assert decision.action == "rewritten"
        assert _same_objects(decision.messages, prefix + [m for block in parts[-k:] for m in block])
    else:
        assert decision.action == "none"
        assert _same_objects(decision.messages, messages)


def test_none_policy_sends_as_is():
    messages = join(*_conversation(4))
    decision = run(create_policy("none").rewrite(_policy_request(messages)))
    assert decision.action == "none"
    assert _same_objects(decision.messages, messages)


# --- pipeline ----------------------------------------------------------------


def _assert_fallback(outcome, rule: str, original: list, snapshot: list):
    assert outcome.action == f"fallback:{rule}"
    assert outcome.is_fallback
    assert _same_objects(outcome.messages, original)
    assert original == snapshot  # the input was not mutated


@pytest.mark.parametrize("session_id", [None, ""])
def test_pipeline_without_session_id_falls_back(session_id):
    messages = join(*_conversation(5))
    snapshot = copy.deepcopy(messages)
    # test_raises would fail if it were called: the rule must fire first
    outcome = run(rewrite_request(messages, session_id, create_policy("test_raises")))
    _assert_fallback(outcome, "missing_session_id", messages, snapshot)


def test_pipeline_with_orphan_tool_result_falls_back():
    prefix, parts = _conversation(5)
    messages = prefix + [{"role": "tool", "tool_call_id": "c0a", "content": "early"}] + join([], parts)
    snapshot = copy.deepcopy(messages)
    outcome = run(rewrite_request(messages, "s1", create_policy("recent_k", {"k": 1})))
    _assert_fallback(outcome, "unsafe_tool_protocol", messages, snapshot)
    assert "orphan_tool_result" in outcome.detail


def test_pipeline_policy_error_falls_back():
    messages = join(*_conversation(5))
    snapshot = copy.deepcopy(messages)
    outcome = run(rewrite_request(messages, "s1", create_policy("test_raises")))
    _assert_fallback(outcome, "policy_error", messages, snapshot)
    assert "RuntimeError" in outcome.detail and "boom" in outcome.detail


def test_pipeline_protocol_breaking_rewrite_falls_back():
    messages = join(*_conversation(5))
    snapshot = copy.deepcopy(messages)
    outcome = run(rewrite_request(messages, "s1", create_policy("test_drops_tool_result")))
    _assert_fallback(outcome, "invalid_rewrite", messages, snapshot)


def test_pipeline_empty_rewrite_falls_back():
    messages = join(*_conversation(3))
    snapshot = copy.deepcopy(messages)
    outcome = run(rewrite_request(messages, "s1", create_policy("test_empty")))
    _assert_fallback(outcome, "invalid_rewrite", messages, snapshot)
    assert outcome.detail == "empty result"


def test_pipeline_passes_a_policy_fallback_through_with_original_messages():
    messages = join(*_conversation(3))
    snapshot = copy.deepcopy(messages)
    outcome = run(rewrite_request(messages, "s1", create_policy("test_self_fallback")))
    _assert_fallback(outcome, "summary_failure", messages, snapshot)
    assert outcome.detail == "summary failed"


def test_a_fallback_must_name_a_rule_of_the_enum():
    assert PolicyDecision.fallback([], Fallback.STORAGE_FAILURE).action == "fallback:storage_failure"
    assert PolicyDecision.fallback([], Fallback.STORAGE_FAILURE).fallback_rule is Fallback.STORAGE_FAILURE
    with pytest.raises(ValueError, match="no_heads"):
        PolicyDecision([], "fallback:no_heads")


def test_pipeline_hands_session_and_vote_to_the_policy():
    messages = join(*_conversation(3))
    vote = HeadVote(head_logits=(0.1, -0.2, 0.3, 0.4, -0.5), votes=3, compress_vote=True)
    _Records.seen.clear()
    outcome = run(rewrite_request(messages, "sess-9", create_policy("test_records"), vote))
    assert outcome.action == "none" and not outcome.is_fallback
    assert len(_Records.seen) == 1
    request = _Records.seen[0]
    assert request.session_id == "sess-9"
    assert request.previous_vote == vote
    assert _same_objects(request.conversation.messages(), messages)


def test_pipeline_recent_k_rewrites():
    prefix, parts = _conversation(5)
    messages = join(prefix, parts)
    outcome = run(rewrite_request(messages, "s1", create_policy("recent_k", {"k": 2})))
    assert outcome.action == "rewritten" and not outcome.is_fallback
    assert _same_objects(outcome.messages, prefix + parts[-2] + parts[-1])


@given(conversations(), st.integers(min_value=1, max_value=5))
def test_pipeline_recent_k_output_is_protocol_safe(conv, k):
    prefix, parts = conv
    messages = join(prefix, parts)
    outcome = run(rewrite_request(messages, "s1", create_policy("recent_k", {"k": k})))
    assert not outcome.is_fallback
    assert protocol_issues(outcome.messages) == []
    assert _same_objects(outcome.messages[: len(prefix)], prefix)
    assert outcome.action == ("rewritten" if len(parts) > k else "none")
    assert len(outcome.messages) == len(prefix) + sum(len(b) for b in parts[max(0, len(parts) - k) :])


def test_variant_serves_a_policy_under_its_own_name():
    from vllm_pamer.core.policies import create_variant

    variant = create_variant("recent_10", {"policy": "recent_k", "k": 10})
    assert variant.name == "recent_10" and variant.config.k == 10
    assert create_variant("recent_k").name == "recent_k"  # plain names stay plain
    with pytest.raises(ValueError, match="hide"):
        create_variant("none", {"policy": "recent_k"})
    with pytest.raises(ValueError, match="bad options"):
        create_variant("recent_0", {"policy": "recent_k", "k": 0})
