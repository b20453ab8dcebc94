"""The paper's baseline policies: sliding_window, discard_tool,
periodic_summary, rolling_summary; and a property over every registered policy.

Summary baselines run on a real SQLite store with deterministic stand-in
engine services; no engine is started."""

from __future__ import annotations

import asyncio
import copy
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.chat_strategies import conversations, join
from tests.support.fakes import COMPRESS, KEEP, FakeEngine, blocking
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, PolicyRequest, available_policies, create_policy
from vllm_pamer.core.policies.baselines import RecentK, SlidingWindow, _LastBlocks
from vllm_pamer.core.policies.summary_baselines import NO_EMBEDDER
from vllm_pamer.core.policies.summary_writer import MEMORY_HEADER
from vllm_pamer.stores.sqlite import SqliteStore


class Services(FakeEngine):
    """The shared stand-in (4 characters a token; a summary lists the ``ID..``
    words of its source; ``complete`` for PaMER+ and SAM) with SAM's window,
    recording sources."""

    max_model_len = 4096

    def __init__(self, summary_error: Exception | None = None) -> None:
        super().__init__()
        self.summary_error = summary_error
        self.sources: list[str] = []

    async def summarize(self, source: str, max_tokens: int) -> str:
        summary = await super().summarize(source, max_tokens)  # raises summary_error first
        self.sources.append(source)
        return summary


def chat(n_blocks: int, chars: int = 400) -> list[dict]:
    """System + task, then ``n_blocks`` blocks: a call and its result ``IDi xxx...``."""
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Task"}]
    for i in range(n_blocks):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": f'{{"k": {i}}}'}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "name": "lookup", "content": f"ID{i} " + "x" * chars})
    return messages


def blocks_of(messages: list[dict], start: int, stop: int | None = None) -> list[dict]:
    return [m for b in split_conversation(messages).blocks[start:stop] for m in b.messages]


def decide(name: str, messages: list[dict], **options):
    policy = create_policy(name, options)
    return asyncio.run(policy.rewrite(PolicyRequest("s1", split_conversation(messages))))


def run(name, messages, store, services, session="s1", vote=None, **options):
    policy = create_policy(name, options)
    return asyncio.run(rewrite_request(messages, session, policy, vote, PolicyContext(store, services)))


@pytest.fixture
def store(tmp_path):
    return SqliteStore(tmp_path / "memory.sqlite3", model_fingerprint="test")


# --- configs -------------------------------------------------------------------


def test_defaults():
    assert create_policy("sliding_window").config.k == 10
    assert create_policy("recent_k").config.k == 2
    assert create_policy("discard_tool").config.window == 2
    periodic = create_policy("periodic_summary").config
    assert (periodic.n, periodic.retained_blocks) == (5, 2)
    rolling = create_policy("rolling_summary").config
    assert (rolling.trigger_tokens, rolling.retained_blocks) == (2048, 2)


@pytest.mark.parametrize(
    "name, options",
    [
        ("sliding_window", {"k": 0}),
        ("discard_tool", {"window": -1}),
        ("periodic_summary", {"n": 0}),
        ("periodic_summary", {"retained_blocks": -1}),
        ("rolling_summary", {"trigger_tokens": 0}),
        ("rolling_summary", {"n": 3}),
    ],
)
def test_bad_options_are_rejected(name, options):
    with pytest.raises(ValueError):
        create_policy(name, options)


# --- sliding_window ------------------------------------------------------------


def test_sliding_window_is_recent_k_with_another_default():
    assert issubclass(SlidingWindow, _LastBlocks) and issubclass(RecentK, _LastBlocks)
    messages = chat(6)
    decision = decide("sliding_window", messages, k=3)
    assert decision.action == "rewritten" and decision.detail == "dropped 3 old blocks"
    assert decision.messages == messages[:2] + blocks_of(messages, 3)
    assert decide("recent_k", messages, k=3).messages == decision.messages


def test_sliding_window_with_few_blocks_sends_as_is():
    messages = chat(10)
    decision = decide("sliding_window", messages)
    assert decision.action == "none" and decision.messages == messages


# --- discard_tool --------------------------------------------------------------


def test_discard_tool_stubs_old_tool_outputs_only():
    messages = chat(4, chars=10)
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
    assert decide("discard_tool", chat(2)).action == "none"
    empty = chat(3)
    empty[3]["content"] = ""
    assert decide("discard_tool", empty).action == "none"  # nothing to remove


# --- periodic_summary ----------------------------------------------------------


def test_periodic_summary_counts_old_blocks(store):
    services = Services()
    options = {"n": 3, "retained_blocks": 2}

    # 4 blocks: 2 old < n -> as is
    outcome = run("periodic_summary", chat(4), store, services, **options)
    assert outcome.action == "none" and outcome.messages == chat(4) and not services.sources

    # 5 blocks: 3 old -> memory 1 covers blocks 0-2
    messages = chat(5)
    outcome = run("periodic_summary", messages, store, services, **options)
    assert outcome.action == "compressed"
    [m1] = blocking(store).load("s1").memories
    memo1 = {"role": "user", "content": f"{MEMORY_HEADER}\n\n[memory {m1.id}] SUMMARY ID0 ID1 ID2"}
    assert outcome.messages == messages[:2] + [memo1] + blocks_of(messages, 3)
    assert m1.embedder == NO_EMBEDDER
    assert list(m1.covered_block_ids) == [b.block_id for b in split_conversation(messages).blocks[:3]]
    assert outcome.tokens_inserted == services.count_tokens([memo1])

    # 7 blocks: live 3-6, 2 old < n -> memory sent, no new summary
    messages = chat(7)
    outcome = run("periodic_summary", messages, store, services, **options)
    assert outcome.action == "recalled" and len(services.sources) == 1
    assert outcome.messages == messages[:2] + [memo1] + blocks_of(messages, 3)

    # 8 blocks: live 3-7, 3 old -> memory 2 covers 3-5; both memories, in id order
    messages = chat(8)
    outcome = run("periodic_summary", messages, store, services, **options)
    assert outcome.action == "compressed"
    m1, m2 = blocking(store).load("s1").memories
    assert m2.summary == "SUMMARY ID3 ID4 ID5"
    memo = f"{MEMORY_HEADER}\n\n[memory {m1.id}] {m1.summary}\n\n[memory {m2.id}] {m2.summary}"
    assert outcome.messages == messages[:2] + [{"role": "user", "content": memo}] + blocks_of(messages, 6)
    assert protocol_issues(outcome.messages) == []


# --- rolling_summary -----------------------------------------------------------


def test_rolling_summary_supersedes_the_previous_summary(store):
    services = Services()
    three_blocks = services.count_tokens(blocks_of(chat(3), 0))
    options = {"trigger_tokens": three_blocks, "retained_blocks": 2}

    # 4 blocks: 2 old below the trigger -> as is
    assert run("rolling_summary", chat(4), store, services, **options).action == "none"

    # 5 blocks: 3 old reach the trigger -> memory 1 of blocks 0-2
    messages = chat(5)
    outcome = run("rolling_summary", messages, store, services, **options)
    [m1] = blocking(store).load("s1").memories
    assert outcome.action == "compressed" and m1.summary == "SUMMARY ID0 ID1 ID2"
    assert outcome.messages == messages[:2] + [
        {"role": "user", "content": f"{MEMORY_HEADER}\n\n[memory {m1.id}] {m1.summary}"}
    ] + blocks_of(messages, 3)

    # 8 blocks: live 3-7, old 3-5 -> one summary of (memory 1 + blocks 3-5) supersedes it
    messages = chat(8)
    outcome = run("rolling_summary", messages, store, services, **options)
    m1, m2 = blocking(store).load("s1").memories
    assert services.sources[-1].startswith(f"summary of the steps before these: {m1.summary}\n")
    assert m2.summary == "SUMMARY ID0 ID1 ID2 ID3 ID4 ID5"
    newest = {"role": "user", "content": f"{MEMORY_HEADER}\n\n[memory {m2.id}] {m2.summary}"}
    assert outcome.action == "compressed"
    assert outcome.messages == messages[:2] + [newest] + blocks_of(messages, 6)

    # 9 blocks: live 6-8, 1 old below the trigger -> prefix + newest summary + live blocks
    messages = chat(9)
    outcome = run("rolling_summary", messages, store, services, **options)
    assert outcome.action == "recalled" and len(services.sources) == 2
    assert outcome.messages == messages[:2] + [newest] + blocks_of(messages, 6)


# --- failures: the original request, nothing stored ------------------------------


@pytest.mark.parametrize("name, options", [("periodic_summary", {"n": 1}), ("rolling_summary", {"trigger_tokens": 1})])
def test_summary_failure_sends_the_original(store, name, options):
    messages = chat(6)
    services = Services(summary_error=RuntimeError("engine down"))
    outcome = run(name, messages, store, services, summary_attempts=2, **options)
    assert outcome.action == "fallback:summary_failure" and "engine down" in outcome.detail
    assert outcome.messages == messages
    assert blocking(store).load("s1").memories == []


@pytest.mark.parametrize("name, options", [("periodic_summary", {"n": 1}), ("rolling_summary", {"trigger_tokens": 1})])
def test_storage_failure_sends_the_original(store, name, options):
    store._conn.execute("CREATE TRIGGER fail BEFORE INSERT ON raw_blocks BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    messages = chat(6)
    outcome = run(name, messages, store, Services(), **options)
    assert outcome.action == "fallback:storage_failure" and "disk full" in outcome.detail
    assert outcome.messages == messages
    assert store._conn.execute("SELECT COUNT(*) FROM memories").fetchone()[0] == 0


@pytest.mark.parametrize("name", ["periodic_summary", "rolling_summary"])
def test_summary_policies_need_a_memory_context(name):
    messages = chat(6)
    outcome = asyncio.run(rewrite_request(messages, "s1", create_policy(name)))
    assert outcome.action == "fallback:policy_error" and "needs a memory store" in outcome.detail
    assert outcome.messages == messages


def test_pamer_never_searches_summary_baseline_memories(store):
    run("periodic_summary", chat(5), store, Services(), n=3)
    outcome = run("pamer", chat(6), store, Services(), vote=KEEP, schedule="paper")
    assert outcome.action == "recalled"  # the memory covers its blocks, but is not searched
    assert MEMORY_HEADER not in str(outcome.messages)
    assert outcome.messages == chat(6)[:2] + blocks_of(chat(6), 3)
    budget = run("pamer", chat(6), store, Services(), vote=KEEP)  # the budget schedule shows none either
    assert budget.action == "rewritten" and budget.messages == outcome.messages


# --- every registered policy: protocol-valid output, prefix first ----------------

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
    context = PolicyContext(shared_store, Services())
    session = f"{name}-{next(_sessions)}"

    async def session_requests():
        for n in range(len(parts) + 1):
            messages = join(prefix, parts[:n])
            snapshot = copy.deepcopy(messages)
            outcome = await rewrite_request(messages, session, policy, votes[n], context)
            assert protocol_issues(outcome.messages) == []
            assert outcome.messages[: len(prefix)] == prefix
            if outcome.is_fallback:
                assert outcome.messages == messages
            assert messages == snapshot

    asyncio.run(session_requests())
