"""Summaries written after their compaction (``core/policies/pamer/summary_after.py``,
the budget schedule's ``summary_after``) on a real SQLite store with the
deterministic engine of tests/support/fakes.py, its summaries slowed down:
the compacting request waits for no summary (its memory is the record), the
summary lands in the stored memory later without changing what the
session's requests show, a later compaction shows it, and a summary that
fails leaves the memory as committed."""

from __future__ import annotations

import asyncio

import numpy as np

from tests.support.fakes import FakeEngine, conversation
from tests.support.sessions import LoopSession
from vllm_pamer.core.blocks import protocol_issues
from vllm_pamer.core.fallback import COMPACTION_ENDS
from vllm_pamer.core.policies import create_policy
from vllm_pamer.core.policies.pamer import summary_after
from vllm_pamer.core.policies.pamer.memory import record_part, shown_message, summary_part, with_summary
from vllm_pamer.core.policies.pamer.record import RECORD_HEADER
from vllm_pamer.core.store import Memory

# conversation(n) is about 32 + 231 n tokens; the band is 1,500-2,000 (test_budget_schedule.py)
BUDGET = {"context_budget": 2000, "band_share": 0.25, "target_share": 0.5, "record_share": 0.2, "memory_share": 0.35}


def Session(store, services, summary_after=True, session="s1"):
    return LoopSession(store, services, {**BUDGET, "summary_after": summary_after}, session)


def _kinds(store, session="s1"):
    return [e["kind"] for e in asyncio.run(store.events(session))]


def test_the_compacting_request_waits_for_no_summary_and_what_is_shown_stays(store):
    async def scenario():
        session = Session(store, FakeEngine(window=8192, summary_delay=0.5))
        first = await session.send(conversation(9))  # the band's top: a compaction
        committed = (await store.load("s1")).memories
        in_flight = session.policy.in_flight("s1")
        await asyncio.sleep(0.8)  # the agent's tools run; the summary is written
        added = (await store.load("s1")).memories
        second = await session.send(conversation(10))
        return first, committed, in_flight, added, second

    first, committed, in_flight, added, second = asyncio.run(scenario())
    assert first.action == "compressed" and first.schedule.memory_seconds < 0.4  # not the summary's 0.5 s
    assert protocol_issues(first.messages) == []
    [memory] = committed
    assert memory.summary.startswith(RECORD_HEADER)  # the record alone, at once
    assert in_flight == {"summaries_after": 1}
    [later] = added
    assert later.id == memory.id and later.summary.startswith("SUMMARY ") and later.summary.endswith(memory.summary)
    assert np.array_equal(later.embedding, memory.embedding)
    # the summary landed between the two requests; what is sent only grew at its end
    assert second.action == "recalled" and second.messages[: len(first.messages)] == first.messages
    assert "SUMMARY" not in str(second.messages)
    kinds = _kinds(store)
    assert kinds.count("compressed") == 1 and kinds.count("summary_added") == 1
    started = kinds.count("compression_started")
    assert started == 1 and sum(k in COMPACTION_ENDS for k in kinds) == started


def test_a_later_compaction_shows_the_older_memorys_summary(store):
    async def scenario():
        session = Session(store, FakeEngine(window=8192, summary_delay=0.05))
        decisions = []
        for n in range(9, 20):
            decisions.append(await session.send(conversation(n)))
            await asyncio.sleep(0.1)
        return decisions

    decisions = asyncio.run(scenario())
    compacted = [d for d in decisions if d.action == "compressed"]
    assert len(compacted) >= 2
    memory_text = str(compacted[-1].messages)
    assert "SUMMARY" in memory_text and RECORD_HEADER in memory_text
    assert _kinds(store).count("summary_added") == len(compacted)


def test_a_summary_that_fails_leaves_the_memory_as_committed(store):
    async def scenario():
        session = Session(store, FakeEngine(window=8192, summary_error=RuntimeError("engine down")))
        first = await session.send(conversation(9))
        await asyncio.sleep(0.2)
        return first, (await store.load("s1")).memories

    first, memories = asyncio.run(scenario())
    assert first.action == "compressed"
    [memory] = memories
    assert memory.summary.startswith(RECORD_HEADER) and len(memory.covered_block_ids) > 0
    events = asyncio.run(store.events("s1"))
    [failed] = [e for e in events if e["kind"] == "summary_not_added"]
    assert failed["detail"]["memory_id"] == memory.id and "engine down" in failed["detail"]["reason"]


def test_inline_summaries_wait_and_show_the_newest_whole(store):
    async def scenario():
        session = Session(store, FakeEngine(window=8192, summary_delay=0.3), summary_after=False)
        return await session.send(conversation(9))

    first = asyncio.run(scenario())
    assert first.action == "compressed" and first.schedule.memory_seconds >= 0.3
    assert "SUMMARY" in str(first.messages)


def _memory(memory_id, text):
    return Memory(memory_id, "s", text, np.ones(2, dtype=np.float32), "e", ("b",), (), 0.0)


def test_the_parts_of_a_memory_text():
    record = f"{RECORD_HEADER}\n- called lookup"
    alone, summarized = _memory(1, record), _memory(2, with_summary(_memory(2, record), "SUMMARY x"))
    assert summarized.summary == f"SUMMARY x\n\n{record}"
    assert (summary_part(alone), record_part(alone)) == ("", record)
    assert (summary_part(summarized), record_part(summarized)) == ("SUMMARY x", record)
    assert record_part(_memory(3, "a summary only")) == "a summary only"
    by_record = shown_message([alone, summarized], newest_whole=False)["content"]
    whole = shown_message([alone, summarized])["content"]
    assert "SUMMARY x" not in by_record and record in by_record and "SUMMARY x" in whole


def test_a_memory_written_ahead_is_written_whole():
    """``write_ahead`` writes the memory, summary included, before it is needed: no summary after."""
    assert create_policy("pamer", {"write_ahead": True}).schedule.later is None
    assert create_policy("pamer", {}).schedule.later is not None  # the default
    assert create_policy("pamer", {"summary_after": False}).schedule.later is None


def test_a_summary_that_copies_the_record_header_is_not_added(store):
    """The shown record is found by its header: a summary holding it would
    split wrongly, so it is refused and the memory keeps its record."""

    async def scenario():
        session = Session(store, FakeEngine(window=8192))

        async def copying(*args, **kwargs):
            return f"notes\n\n{RECORD_HEADER}\n- called lookup"

        session.policy.schedule.later.writer.summarize = copying
        first = await session.send(conversation(9))
        await asyncio.sleep(0.1)
        return first, (await store.load("s1")).memories

    first, [memory] = asyncio.run(scenario())
    assert first.action == "compressed" and memory.summary.startswith(RECORD_HEADER)
    [refused] = [e for e in asyncio.run(store.events("s1")) if e["kind"] == "summary_not_added"]
    assert "header" in refused["detail"]["reason"]


def test_past_the_pending_cap_a_summary_is_not_written_and_the_event_says_so(store, monkeypatch):
    monkeypatch.setattr(summary_after, "MAX_PENDING", 0)

    async def scenario():
        services = FakeEngine(window=8192)
        first = await Session(store, services).send(conversation(9))
        await asyncio.sleep(0.1)
        return first, services.summaries

    first, summaries = asyncio.run(scenario())
    assert first.action == "compressed" and summaries == 0
    [compressed] = [e for e in asyncio.run(store.events("s1")) if e["kind"] == "compressed"]
    assert compressed["detail"]["summary"] == "none"


def test_a_session_has_one_summary_pending_at_most(store):
    """A compaction while the session's previous summary is still written
    leaves its own unwritten (its memory keeps its record); the next one
    after the first lands writes its summary again."""

    async def scenario():
        session = Session(store, FakeEngine(window=8192, summary_delay=0.5))
        actions = []
        for n in range(9, 22):  # compactions closer together than a summary takes
            actions.append((await session.send(conversation(n))).action)
        await asyncio.sleep(0.7)
        return actions, session.policy.in_flight("s1")

    actions, in_flight = asyncio.run(scenario())
    assert actions.count("compressed") >= 2 and in_flight is None
    events = asyncio.run(store.events("s1"))
    labels = [e["detail"]["summary"] for e in events if e["kind"] == "compressed"]
    assert labels[0] == "after" and "none" in labels, labels
    assert sum(e["kind"] == "summary_added" for e in events) == labels.count("after")
