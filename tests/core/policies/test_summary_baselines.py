"""The summary baselines (``core/policies/summary_baselines.py``):
periodic_summary and rolling_summary on a real SQLite store with
deterministic stand-in engine services (no engine is started); a failure
sends the original request and stores nothing; PaMER never searches their
memories."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.fakes import KEEP, FakeEngine, blocking, blocks_of, lookup_chat
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, PolicyRequest, create_policy
from vllm_pamer.core.policies.summary_baselines import NO_EMBEDDER
from vllm_pamer.core.policies.summary_writer import MEMORY_HEADER


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


def run(name, messages, store, services, session="s1", vote=None, **options):
    policy = create_policy(name, options)
    return asyncio.run(
        rewrite_request(
            policy,
            PolicyRequest(
                messages=messages, session_id=session, previous_vote=vote, context=PolicyContext(store, services)
            ),
        )
    )


def test_defaults():
    periodic = create_policy("periodic_summary").config
    assert (periodic.n, periodic.retained_blocks) == (5, 2)
    rolling = create_policy("rolling_summary").config
    assert (rolling.trigger_tokens, rolling.retained_blocks) == (2048, 2)


@pytest.mark.parametrize(
    "name, options",
    [
        ("periodic_summary", {"n": 0}),
        ("periodic_summary", {"retained_blocks": -1}),
        ("rolling_summary", {"trigger_tokens": 0}),
        ("rolling_summary", {"n": 3}),
    ],
)
def test_bad_options_are_rejected(name, options):
    with pytest.raises(ValueError):
        create_policy(name, options)


def test_periodic_summary_counts_old_blocks(store):
    services = Services()
    options = {"n": 3, "retained_blocks": 2}

    # 4 blocks: 2 old < n -> as is
    outcome = run("periodic_summary", lookup_chat(4), store, services, **options)
    assert outcome.action == "none" and outcome.messages == lookup_chat(4) and not services.sources

    # 5 blocks: 3 old -> memory 1 covers blocks 0-2
    messages = lookup_chat(5)
    outcome = run("periodic_summary", messages, store, services, **options)
    assert outcome.action == "compressed"
    [m1] = blocking(store).load("s1").memories
    memo1 = {"role": "user", "content": f"{MEMORY_HEADER}\n\n[memory {m1.id}] SUMMARY ID0 ID1 ID2"}
    assert outcome.messages == messages[:2] + [memo1] + blocks_of(messages, 3)
    assert m1.embedder == NO_EMBEDDER
    assert list(m1.covered_block_ids) == [b.block_id for b in split_conversation(messages).blocks[:3]]
    assert outcome.tokens_inserted == services.count_tokens([memo1])

    # 7 blocks: live 3-6, 2 old < n -> memory sent, no new summary
    messages = lookup_chat(7)
    outcome = run("periodic_summary", messages, store, services, **options)
    assert outcome.action == "recalled" and len(services.sources) == 1
    assert outcome.messages == messages[:2] + [memo1] + blocks_of(messages, 3)

    # 8 blocks: live 3-7, 3 old -> memory 2 covers 3-5; both memories, in id order
    messages = lookup_chat(8)
    outcome = run("periodic_summary", messages, store, services, **options)
    assert outcome.action == "compressed"
    m1, m2 = blocking(store).load("s1").memories
    assert m2.summary == "SUMMARY ID3 ID4 ID5"
    memo = f"{MEMORY_HEADER}\n\n[memory {m1.id}] {m1.summary}\n\n[memory {m2.id}] {m2.summary}"
    assert outcome.messages == messages[:2] + [{"role": "user", "content": memo}] + blocks_of(messages, 6)
    assert protocol_issues(outcome.messages) == []


def test_rolling_summary_supersedes_the_previous_summary(store):
    services = Services()
    three_blocks = services.count_tokens(blocks_of(lookup_chat(3), 0))
    options = {"trigger_tokens": three_blocks, "retained_blocks": 2}

    # 4 blocks: 2 old below the trigger -> as is
    assert run("rolling_summary", lookup_chat(4), store, services, **options).action == "none"

    # 5 blocks: 3 old reach the trigger -> memory 1 of blocks 0-2
    messages = lookup_chat(5)
    outcome = run("rolling_summary", messages, store, services, **options)
    [m1] = blocking(store).load("s1").memories
    assert outcome.action == "compressed" and m1.summary == "SUMMARY ID0 ID1 ID2"
    assert outcome.messages == messages[:2] + [
        {"role": "user", "content": f"{MEMORY_HEADER}\n\n[memory {m1.id}] {m1.summary}"}
    ] + blocks_of(messages, 3)

    # 8 blocks: live 3-7, old 3-5 -> one summary of (memory 1 + blocks 3-5) supersedes it
    messages = lookup_chat(8)
    outcome = run("rolling_summary", messages, store, services, **options)
    m1, m2 = blocking(store).load("s1").memories
    assert services.sources[-1].startswith(f"summary of the steps before these: {m1.summary}\n")
    assert m2.summary == "SUMMARY ID0 ID1 ID2 ID3 ID4 ID5"
    newest = {"role": "user", "content": f"{MEMORY_HEADER}\n\n[memory {m2.id}] {m2.summary}"}
    assert outcome.action == "compressed"
    assert outcome.messages == messages[:2] + [newest] + blocks_of(messages, 6)

    # 9 blocks: live 6-8, 1 old below the trigger -> prefix + newest summary + live blocks
    messages = lookup_chat(9)
    outcome = run("rolling_summary", messages, store, services, **options)
    assert outcome.action == "recalled" and len(services.sources) == 2
    assert outcome.messages == messages[:2] + [newest] + blocks_of(messages, 6)


@pytest.mark.parametrize("name, options", [("periodic_summary", {"n": 1}), ("rolling_summary", {"trigger_tokens": 1})])
def test_summary_failure_sends_the_original(store, name, options):
    messages = lookup_chat(6)
    services = Services(summary_error=RuntimeError("engine down"))
    outcome = run(name, messages, store, services, summary_attempts=2, **options)
    assert outcome.action == "fallback:summary_failure" and "engine down" in outcome.detail
    assert outcome.messages == messages
    assert blocking(store).load("s1").memories == []


@pytest.mark.parametrize("name, options", [("periodic_summary", {"n": 1}), ("rolling_summary", {"trigger_tokens": 1})])
def test_storage_failure_sends_the_original(store, name, options):
    store._conn.execute("CREATE TRIGGER fail BEFORE INSERT ON raw_blocks BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    messages = lookup_chat(6)
    outcome = run(name, messages, store, Services(), **options)
    assert outcome.action == "fallback:storage_failure" and "disk full" in outcome.detail
    assert outcome.messages == messages
    assert store._conn.execute("SELECT COUNT(*) FROM memories").fetchone()[0] == 0


@pytest.mark.parametrize("name", ["periodic_summary", "rolling_summary"])
def test_summary_policies_need_a_memory_context(name):
    messages = lookup_chat(6)
    outcome = asyncio.run(rewrite_request(create_policy(name), PolicyRequest(messages=messages, session_id="s1")))
    assert outcome.action == "fallback:policy_error" and "needs a memory store" in outcome.detail
    assert outcome.messages == messages


def test_pamer_never_searches_summary_baseline_memories(store):
    run("periodic_summary", lookup_chat(5), store, Services(), n=3)
    outcome = run("pamer", lookup_chat(6), store, Services(), vote=KEEP, schedule="paper")
    assert outcome.action == "recalled"  # the memory covers its blocks, but is not searched
    assert MEMORY_HEADER not in str(outcome.messages)
    assert outcome.messages == lookup_chat(6)[:2] + blocks_of(lookup_chat(6), 3)
    budget = run("pamer", lookup_chat(6), store, Services(), vote=KEEP)  # the budget schedule shows none either
    assert budget.action == "rewritten" and budget.messages == outcome.messages
