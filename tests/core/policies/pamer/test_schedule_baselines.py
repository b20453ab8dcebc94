"""The baselines on PaMER's budget schedule (core/policies/pamer/schedule_baselines.py):
the same compactions with nothing, the record alone or the masked blocks in
place of PaMER's memory, on a real SQLite store with the deterministic engine
of tests/support/fakes.py (4 characters a token)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.fakes import COMPRESS, KEEP, FakeEngine, blocking, conversation
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, PolicyRequest, create_policy
from vllm_pamer.core.policies.baselines import tool_placeholder
from vllm_pamer.core.policies.pamer.memory import EXCERPT_MARK
from vllm_pamer.core.policies.pamer.record import RECORD_HEADER
from vllm_pamer.core.policies.summary_writer import MEMORY_HEADER
from vllm_pamer.stores.sqlite import SqliteStore

# as tests/test_compaction.py: conversation(n) is about 32 + 231 n tokens, the band at 1,500-2,000
SCHEDULE = {"context_budget": 2000, "band_share": 0.25, "target_share": 0.5}


class CountingEngine(FakeEngine):
    def __init__(self, **kwargs):
        super().__init__(window=8192, **kwargs)
        self.embeds = 0

    async def embed(self, text):
        self.embeds += 1
        return await super().embed(text)


def replay(store, policy_name, blocks=range(2, 20), vote=lambda n: KEEP, **options):
    """One session's requests through the pipeline, as the endpoint sends them."""
    services = CountingEngine()
    policy = create_policy(policy_name, {**SCHEDULE, **options})
    context = PolicyContext(store, services)
    out = []
    for n in blocks:
        messages = conversation(n)
        tokens = services.count_tokens(messages)
        out.append(
            (
                messages,
                asyncio.run(
                    rewrite_request(
                        policy,
                        PolicyRequest(
                            messages=messages,
                            session_id="s1",
                            previous_vote=vote(n),
                            context=context,
                            prompt_tokens=tokens,
                        ),
                    )
                ),
            )
        )
    return out, services


def _compactions(out):
    return [i for i, (_, o) in enumerate(out) if o.action == "compressed"]


@pytest.mark.parametrize("policy", ["truncate", "record_only", "observation_masking", "excerpt_masking"])
def test_a_baseline_compacts_where_pamer_first_does_and_never_breaks_the_protocol(tmp_path, policy):
    """The schedule is shared: the first compaction comes at the same request
    (the band's top here, the vote inside it), and every request stays valid."""
    for vote in (lambda n: KEEP, lambda n: COMPRESS if n >= 7 else KEEP):
        pamer, _ = replay(
            SqliteStore(tmp_path / f"p{id(vote)}.db"), "pamer", vote=vote, record_share=0.2, memory_share=0.35
        )
        other, _ = replay(SqliteStore(tmp_path / f"{policy}{id(vote)}.db"), policy, vote=vote)
        assert _compactions(other) and _compactions(other)[0] == _compactions(pamer)[0]
        for _, outcome in other:
            assert outcome.fallback_rule is None, outcome.detail
            assert protocol_issues(outcome.messages) == []
            assert outcome.schedule is not None and outcome.schedule.sent_tokens <= 2000 + 300


def test_truncate_drops_the_archived_blocks_and_asks_the_engine_nothing(store):
    out, services = replay(store, "truncate")
    assert services.summaries == 0 and services.embeds == 0 and services.conversation_summaries == 0
    first = _compactions(out)[0]
    history, compacted = out[first]
    live = list(split_conversation(history).blocks)
    sent = split_conversation(compacted.messages)
    assert compacted.messages[:2] == history[:2] and not any(
        MEMORY_HEADER in str(m.get("content")) for m in sent.prefix
    )
    assert [b.block_id for b in sent.blocks] == [b.block_id for b in live[-len(sent.blocks) :]]  # the newest blocks
    stored = blocking(store).load("s1").memories
    assert stored and all(m.embedder == "truncated" for m in stored)  # the dropped blocks are kept in the store
    archived = {b for m in stored for b in m.covered_block_ids}
    assert {b.block_id for b in live[: len(live) - len(sent.blocks)]} <= archived


def test_between_compactions_a_baseline_sends_append_only(store):
    for policy in ("truncate", "record_only", "observation_masking", "excerpt_masking"):
        out, _ = replay(SqliteStore(store.path.with_name(f"{policy}.db")), policy)
        cuts = set(_compactions(out))
        for i in range(1, len(out)):
            if i in cuts:
                continue
            before, now = out[i - 1][1].messages, out[i][1].messages
            assert now[: len(before)] == before, (policy, i)  # what was sent only grows at its end


def test_record_only_shows_the_record_without_a_summary_request(store):
    out, services = replay(store, "record_only", record_share=0.2)
    assert services.summaries == 0 and services.conversation_summaries == 0 and services.embeds == 0
    _, compacted = out[_compactions(out)[0]]
    memory = compacted.messages[2]["content"]
    assert memory.startswith(MEMORY_HEADER) and RECORD_HEADER in memory
    assert "SUMMARY" not in memory and 'called lookup({"k": "ID0"})' in memory
    assert all(m.summary.startswith(RECORD_HEADER) for m in blocking(store).load("s1").memories)


def test_observation_masking_keeps_the_agents_turns_and_masks_the_outputs(store):
    out, services = replay(store, "observation_masking")
    assert services.summaries == 0 and services.embeds == 0
    history, compacted = out[_compactions(out)[0]]
    sent = compacted.messages
    kept = {b.block_id for b in split_conversation(sent).blocks}
    masked = [
        b
        for b in split_conversation(sent).blocks
        if b.block_id not in {x.block_id for x in split_conversation(history).blocks}
    ]
    assert masked, "the archived blocks come back masked"
    for block in masked:
        call, result = block.messages
        assert call["tool_calls"] and result["content"] == tool_placeholder(len("ID0 ") + 900)
    original_calls = [m for m in history if m.get("tool_calls")]
    assert [m for m in sent if m.get("tool_calls")] == original_calls  # every call of the agent, verbatim
    assert kept


def test_excerpt_masking_keeps_the_agents_turns_and_lines_of_the_outputs(store):
    out, services = replay(store, "excerpt_masking")
    assert services.summaries == 0 and services.embeds == 0
    history, compacted = out[_compactions(out)[0]]
    sent = compacted.messages
    inserted = [m for m in sent if m.get("role") == "tool" and m not in history]
    assert inserted, "the archived outputs come back masked"
    assert all(m["content"].startswith(tool_placeholder(len("ID0 ") + 900)) for m in inserted)
    assert any(EXCERPT_MARK in m["content"] for m in inserted)  # lines kept after the placeholder
    assert [m for m in sent if m.get("tool_calls")] == [m for m in history if m.get("tool_calls")]
    assert protocol_issues(sent) == [] and services.count_tokens(sent) < compacted.schedule.sent_tokens


@pytest.mark.parametrize("policy", ["record_only", "pamer"])
def test_with_turns_share_the_record_is_followed_by_the_newest_archived_turns_masked(store, policy):
    """The memory (PaMER's summary and record, or the record alone), then the
    newest archived blocks whole with their outputs masked, then the live
    blocks: the agent's calls of those blocks verbatim in place, and not
    again in the record; the newest memory's text whole, the turns after
    the memory message (PaMER's older summaries: the next test)."""
    out, services = replay(store, policy, range(2, 40), record_share=0.2, turns_share=0.25)
    summaries = services.summaries + services.conversation_summaries
    assert (summaries > 0) == (policy == "pamer")
    cuts = _compactions(out)
    assert len(cuts) >= 2
    history, last = out[-1][0], out[-1][1]
    sent = last.messages
    memory = sent[2]
    assert memory["role"] == "user" and memory["content"].startswith(MEMORY_HEADER)
    assert RECORD_HEADER in memory["content"] and "step 1:" in memory["content"]  # the record spans every step
    calls = [m for m in sent if m.get("tool_calls")]
    first_raw = history.index(calls[0])
    assert calls == [m for m in history[first_raw:] if m.get("tool_calls")]  # no gap up to the live blocks
    raw = {b.block_id for b in split_conversation(history).blocks}
    turns = [b for b in split_conversation(sent).blocks if b.block_id not in raw]  # changed: masked
    assert turns
    for block in turns:
        i = block.messages[1]["tool_call_id"][1:]
        assert block.messages[1]["content"] == tool_placeholder(len(f"ID{i} ") + 900)
        arguments = block.messages[0]["tool_calls"][0]["function"]["arguments"]
        assert f"called lookup({arguments})" not in memory["content"]  # shown raw: not copied in the record
    assert 'called lookup({"k": "ID0"})' in memory["content"]  # an older call is
    assert protocol_issues(sent) == [] and last.schedule.sent_tokens <= 2000
    stored = blocking(store).load("s1").memories
    assert {m.embedder for m in stored} == {"record-turns" if policy == "record_only" else "bag-of-words"}
    assert services.embeds == (len(stored) if policy == "pamer" else 0)  # a summary is recalled by its embedding
    assert max(last.recalled or ()) == max(m.id for m in stored)
    if policy == "record_only":
        assert last.recalled == (max(m.id for m in stored),)  # a record alone: the newest covers every step


def test_pamer_with_turns_recalls_older_summaries_beside_the_newest_turns(store):
    """PaMER with ``turns_share``: one memory message (older memories by
    their summaries, the newest whole), then the newest memory's turns; the
    older memories' turns are not shown again. The turns have their own room
    beside ``memory_share``, so older summaries fit at its default."""
    # memory_share as default; the summary inline: each request runs in its own event loop
    out, _ = replay(store, "pamer", range(2, 60), record_share=0.1, turns_share=0.1, summary_after=False)
    last = out[-1][1]
    assert last.recalled is not None and len(last.recalled) >= 2, last.recalled
    sent = last.messages
    memory = sent[2]["content"]
    assert memory.startswith(MEMORY_HEADER) and all(f"[memory {i}]" in memory for i in last.recalled)
    assert memory.count(RECORD_HEADER) == 1 and '"turns"' not in memory  # older ones by their summaries
    assert protocol_issues(sent) == [] and last.schedule.sent_tokens <= 2000
    raw = {b.block_id for b in split_conversation(out[-1][0]).blocks}
    masked = [b for b in split_conversation(sent).blocks if b.block_id not in raw]
    calls = [m for m in sent if m.get("tool_calls")]
    assert masked and calls == [m for m in out[-1][0][out[-1][0].index(calls[0]) :] if m.get("tool_calls")]


@pytest.mark.parametrize("policy", ["observation_masking", "excerpt_masking"])
def test_the_masked_history_keeps_its_newest_steps_within_its_share(tmp_path, policy):
    """The masked steps shown are the newest that fit ``memory_share`` of the
    budget, contiguous up to the live blocks; past it the oldest leave."""
    shown = {}
    for share in (0.1, 0.35):
        out, _ = replay(SqliteStore(tmp_path / f"{share}.db"), policy, range(2, 60), memory_share=share)
        last = out[-1][1]
        calls = [int(m["tool_calls"][0]["id"][1:]) for m in last.messages if m.get("tool_calls")]
        assert calls == list(range(calls[0], 59)), calls  # no gap: the newest masked steps, then the live ones
        assert protocol_issues(last.messages) == [] and last.schedule.sent_tokens <= 2000
        shown[share] = calls[0]
    assert 0 < shown[0.35] < shown[0.1]  # a larger share keeps older steps; neither keeps the first


@pytest.mark.parametrize(
    "policy, option",
    [
        ("truncate", "summary_max_tokens"),
        ("truncate", "record_share"),
        ("record_only", "summary_layout"),
        ("observation_masking", "top_k"),
        ("observation_masking", "record_share"),
        ("excerpt_masking", "summary_max_tokens"),
        ("record_only", "top_k"),
        ("record_only", "memory_share"),
        ("record_only", "schedule"),
        ("observation_masking", "turns_share"),
        ("excerpt_masking", "turns_share"),
    ],
)
def test_a_baseline_refuses_the_options_it_does_not_read(policy, option):
    with pytest.raises(ValueError, match=option):
        create_policy(policy, {option: 1})


def test_every_budget_option_is_in_exactly_one_group_of_what_the_baselines_read():
    """So a new budget option is classified (read by the schedule, by a shown
    memory, by a record, by a summary) before the baselines take it."""
    from vllm_pamer.core.policies.pamer import BudgetConfig
    from vllm_pamer.core.policies.pamer.schedule_baselines import (
        RECORD_OPTIONS,
        SCHEDULE_OPTIONS,
        SHOWN_OPTIONS,
        SIMILARITY_OPTIONS,
        SUMMARY_OPTIONS,
        TURNS_OPTIONS,
    )

    groups = [SCHEDULE_OPTIONS, SHOWN_OPTIONS, RECORD_OPTIONS, TURNS_OPTIONS, SIMILARITY_OPTIONS, SUMMARY_OPTIONS]
    fields = set(BudgetConfig.__struct_fields__) - {"schedule"}
    assert set().union(*groups) == fields
    assert sum(len(g) for g in groups) == len(fields)  # no option in two groups


def test_the_record_beside_turns_may_keep_lines_of_the_outputs_they_mask():
    """The turns hold their calls, not their outputs: a rare line of a masked
    output is the record's to keep, a call shown raw is not."""
    from vllm_pamer.core.blocks import Block
    from vllm_pamer.core.policies.pamer.memory import turn_messages
    from vllm_pamer.core.policies.pamer.record import step_record

    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "grep -rn TOKEN"}'}}
    turn = Block(
        (
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "src/auth/session_store.py:88: TOKEN_TTL = 3600"},
        )
    )
    prefix = [{"role": "user", "content": "Task: fix the expiry"}]
    record = step_record([turn], [], 2000, known=[*prefix, *turn_messages([turn])])
    assert "session_store.py:88: TOKEN_TTL = 3600" in record
    assert "called bash" not in record


def test_a_stored_memory_reads_as_text_and_turns_whatever_its_kind():
    import numpy as np

    from vllm_pamer.core.policies.pamer.memory import stored_turns, turns_text
    from vllm_pamer.core.store import Memory

    def memory(text):
        return Memory(1, "s1", text, np.zeros(2, dtype=np.float32), "e", (), (), 0.0)

    turn = {"role": "assistant", "content": "ls"}
    assert (
        stored_turns(memory(turns_text("SUMMARY", [turn]))).text,
        stored_turns(memory(turns_text("S", [turn]))).turns,
    ) == ("SUMMARY", [turn])
    for plain in ('{"text": "a summary that opens like JSON"} and goes on', '{"text": 3}', "plain"):
        assert stored_turns(memory(plain)).text == plain and stored_turns(memory(plain)).turns == []
