"""The pipeline (``core/pipeline.py``): each fallback rule sends the original
request and never mutates it; what the pipeline hands the policy; and, for
every registered policy as a session grows, a protocol-valid rewrite that
starts with the prefix (``OPTIONS`` sets a policy's options there; a policy
it does not name runs with its defaults)."""

from __future__ import annotations

import asyncio
import copy
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.chat_strategies import conversations, join
from tests.support.fakes import COMPRESS, KEEP, FakeEngine, mixed_conversation, same_objects
from vllm_pamer.core.blocks import protocol_issues
from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import (
    HeadVote,
    MemoryPolicy,
    PolicyContext,
    PolicyDecision,
    PolicyRequest,
    available_policies,
    create_policy,
    register_policy,
)
from vllm_pamer.stores.sqlite import SqliteStore

# test-only policies (module level: registered once per test session)


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


def _assert_fallback(outcome, rule: str, original: list, snapshot: list):
    assert outcome.action == f"fallback:{rule}"
    assert outcome.fallback_rule is not None
    assert same_objects(outcome.messages, original)
    assert original == snapshot  # the input was not mutated


@pytest.mark.parametrize("session_id", [None, ""])
def test_pipeline_without_session_id_falls_back(session_id):
    messages = join(*mixed_conversation(5))
    snapshot = copy.deepcopy(messages)
    # test_raises would fail if it were called: the rule must fire first
    outcome = run(
        rewrite_request(create_policy("test_raises"), PolicyRequest(messages=messages, session_id=session_id))
    )
    _assert_fallback(outcome, "missing_session_id", messages, snapshot)


def test_pipeline_with_orphan_tool_result_falls_back():
    prefix, parts = mixed_conversation(5)
    messages = prefix + [{"role": "tool", "tool_call_id": "c0a", "content": "early"}] + join([], parts)
    snapshot = copy.deepcopy(messages)
    outcome = run(
        rewrite_request(create_policy("recent_k", {"k": 1}), PolicyRequest(messages=messages, session_id="s1"))
    )
    _assert_fallback(outcome, "unsafe_tool_protocol", messages, snapshot)
    assert "orphan_tool_result" in outcome.detail


def test_pipeline_policy_error_falls_back():
    messages = join(*mixed_conversation(5))
    snapshot = copy.deepcopy(messages)
    outcome = run(rewrite_request(create_policy("test_raises"), PolicyRequest(messages=messages, session_id="s1")))
    _assert_fallback(outcome, "policy_error", messages, snapshot)
    assert "RuntimeError" in outcome.detail and "boom" in outcome.detail


def test_pipeline_protocol_breaking_rewrite_falls_back():
    messages = join(*mixed_conversation(5))
    snapshot = copy.deepcopy(messages)
    outcome = run(
        rewrite_request(create_policy("test_drops_tool_result"), PolicyRequest(messages=messages, session_id="s1"))
    )
    _assert_fallback(outcome, "invalid_rewrite", messages, snapshot)


def test_pipeline_empty_rewrite_falls_back():
    messages = join(*mixed_conversation(3))
    snapshot = copy.deepcopy(messages)
    outcome = run(rewrite_request(create_policy("test_empty"), PolicyRequest(messages=messages, session_id="s1")))
    _assert_fallback(outcome, "invalid_rewrite", messages, snapshot)
    assert outcome.detail == "empty result"


def test_pipeline_passes_a_policy_fallback_through_with_original_messages():
    messages = join(*mixed_conversation(3))
    snapshot = copy.deepcopy(messages)
    outcome = run(
        rewrite_request(create_policy("test_self_fallback"), PolicyRequest(messages=messages, session_id="s1"))
    )
    _assert_fallback(outcome, "summary_failure", messages, snapshot)
    assert outcome.detail == "summary failed"


def test_pipeline_hands_session_and_vote_to_the_policy():
    messages = join(*mixed_conversation(3))
    vote = HeadVote(head_logits=(0.1, -0.2, 0.3, 0.4, -0.5), votes=3, compress_vote=True)
    _Records.seen.clear()
    outcome = run(
        rewrite_request(
            create_policy("test_records"), PolicyRequest(messages=messages, session_id="sess-9", previous_vote=vote)
        )
    )
    assert outcome.action == "none" and outcome.fallback_rule is None
    assert len(_Records.seen) == 1
    request = _Records.seen[0]
    assert request.session_id == "sess-9"
    assert request.previous_vote == vote
    assert same_objects(request.conversation.messages(), messages)


def test_pipeline_recent_k_rewrites():
    prefix, parts = mixed_conversation(5)
    messages = join(prefix, parts)
    outcome = run(
        rewrite_request(create_policy("recent_k", {"k": 2}), PolicyRequest(messages=messages, session_id="s1"))
    )
    assert outcome.action == "rewritten" and outcome.fallback_rule is None
    assert same_objects(outcome.messages, prefix + parts[-2] + parts[-1])


@given(conversations(), st.integers(min_value=1, max_value=5))
def test_pipeline_recent_k_output_is_protocol_safe(conv, k):
    prefix, parts = conv
    messages = join(prefix, parts)
    outcome = run(
        rewrite_request(create_policy("recent_k", {"k": k}), PolicyRequest(messages=messages, session_id="s1"))
    )
    assert outcome.fallback_rule is None
    assert protocol_issues(outcome.messages) == []
    assert same_objects(outcome.messages[: len(prefix)], prefix)
    assert outcome.action == ("rewritten" if len(parts) > k else "none")
    assert len(outcome.messages) == len(prefix) + sum(len(b) for b in parts[max(0, len(parts) - k) :])


# every registered policy: protocol-valid output, prefix first

OPTIONS = {
    "sliding_window": {"k": 1},
    "discard_tool": {"window": 1},
    "periodic_summary": {"n": 1, "retained_blocks": 1},
    "rolling_summary": {"trigger_tokens": 1, "retained_blocks": 1},
    "pamer": {"context_budget": 120, "retained_blocks": 1},  # the budget schedule, compacting often
    "pamer_plus": {"min_candidate_tokens": 1, "retained_blocks": 1},
    "sam": {"trigger_tokens": 1, "page_tokens": 50, "retained_blocks": 1},
}


POLICIES = [name for name in available_policies() if not name.startswith("test_")]


_sessions = itertools.count()


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    return SqliteStore(tmp_path_factory.mktemp("property") / "memory.sqlite3")


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=40, deadline=None)
@given(conv=conversations(), votes=st.lists(st.sampled_from([COMPRESS, KEEP, None]), min_size=7, max_size=7))
def test_every_policy_keeps_protocol_and_prefix(shared_store, name, conv, votes):
    """The agent's session grows block by block; every request's rewrite is
    protocol-valid and starts with the prefix."""
    prefix, parts = conv
    policy = create_policy(name, OPTIONS.get(name, {}))
    context = PolicyContext(shared_store, FakeEngine(window=4096))
    session = f"{name}-{next(_sessions)}"

    async def session_requests():
        for n in range(len(parts) + 1):
            messages = join(prefix, parts[:n])
            snapshot = copy.deepcopy(messages)
            outcome = await rewrite_request(
                policy, PolicyRequest(messages=messages, session_id=session, previous_vote=votes[n], context=context)
            )
            assert protocol_issues(outcome.messages) == []
            assert outcome.messages[: len(prefix)] == prefix
            if outcome.fallback_rule is not None:
                assert outcome.messages == messages
            assert messages == snapshot

    asyncio.run(session_requests())
