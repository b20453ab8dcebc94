"""Memories written ahead of need (``core/policies/pamer/ahead.py``, the budget
schedule's ``write_ahead``) on a real SQLite store with the deterministic
engine of tests/support/fakes.py, its summaries slowed down: the request that
calls for a compaction goes out as it is, the first one after the memory is
ready compacts with it, only a request the window cannot hold waits, and a
memory whose blocks are no longer the oldest is abandoned. Every
``compression_started`` ends in an event."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from tests.support.fakes import FakeEngine, conversation
from tests.support.sessions import LoopSession
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.fallback import COMPACTION_ENDS
from vllm_pamer.core.policies.pamer.ahead import AheadWrites, _InFlight

# conversation(n) is about 32 + 231 n tokens; the band is 1,500-2,000 (test_budget_schedule.py)
BUDGET = {"context_budget": 2000, "band_share": 0.25, "target_share": 0.5, "record_share": 0.2, "memory_share": 0.35}


def Session(store, services, write_ahead=True, session="s1"):
    # without write_ahead: the synchronous schedule, its summary inline
    return LoopSession(store, services, {**BUDGET, "write_ahead": write_ahead, "summary_after": False}, session)


def _ends(events):
    """Every compression_started is followed by its end (compressed, abandoned or a failure)."""
    started = ends = 0
    for event in events:
        started += event["kind"] == "compression_started"
        ends += event["kind"] in COMPACTION_ENDS
    return started, ends


def test_the_request_that_calls_for_a_compaction_goes_out_as_it_is(store):
    """At the band's top the memory is written in the background and the
    request is sent whole; the first request after it is ready compacts with
    the blocks a synchronous compaction would have archived."""

    async def scenario():
        ahead = Session(store, FakeEngine(window=8192, summary_delay=0.3))
        first = await ahead.send(conversation(9))  # ~2,100 tokens: the band's top, fits the window
        stored_then = (await store.load("s1")).memories
        shown = [ahead.policy.in_flight("s1")]  # what the session route shows
        await asyncio.sleep(0.6)  # the agent's tools run; the memory is written
        shown.append(ahead.policy.in_flight("s1"))
        second = await ahead.send(conversation(10))
        shown.append(ahead.policy.in_flight("s1"))
        synchronous = Session(store, FakeEngine(window=8192), write_ahead=False, session="s2")
        reference = await synchronous.send(conversation(9))
        return first, stored_then, second, reference, shown

    first, stored_then, second, reference, shown = asyncio.run(scenario())
    assert shown[0]["trigger"] == "top_of_band" and not shown[0]["ready"] and shown[0]["blocks"] > 0
    assert shown[1]["ready"] and shown[1]["seconds"] >= 0.3 and shown[2] is None
    assert first.action == "none" and first.schedule.trigger is None and "written ahead" in first.detail
    assert first.messages == conversation(9) and stored_then == []
    assert second.action == "compressed" and second.schedule.trigger == "top_of_band"
    assert second.schedule.memory_ahead and second.schedule.memory_seconds >= 0.3
    assert protocol_issues(second.messages) == [] and second.messages[-2:] == conversation(10)[-2:]
    assert reference.action == "compressed" and not reference.schedule.memory_ahead
    [memory] = asyncio.run(store.load("s1")).memories
    [expected] = asyncio.run(store.load("s2")).memories
    blocks = split_conversation(conversation(10)).blocks
    assert len(memory.covered_block_ids) == len(expected.covered_block_ids)
    assert list(memory.covered_block_ids) == [b.block_id for b in blocks[: len(memory.covered_block_ids)]]
    assert _ends(asyncio.run(store.events("s1"))) == (1, 1)


def test_only_a_request_the_window_cannot_hold_waits(store):
    async def scenario():
        session = Session(store, FakeEngine(window=2_600, summary_delay=0.3))
        first = await session.send(conversation(9))  # fits: the memory starts
        over = await session.send(conversation(12))  # ~2,800 tokens: past the window, so it waits
        return first, over

    first, over = asyncio.run(scenario())
    assert first.action == "none" and "written ahead" in first.detail
    assert over.action == "compressed" and not over.schedule.memory_ahead and over.schedule.memory_seconds > 0.1
    assert over.schedule.trigger == "top_of_band"  # the compaction the memory was started for
    assert FakeEngine().count_tokens(over.messages) < 2_600 and protocol_issues(over.messages) == []
    assert _ends(asyncio.run(store.events("s1"))) == (1, 1)


def test_a_memory_whose_blocks_are_no_longer_the_oldest_is_abandoned(store):
    """Another process compacted the session, or the agent edited its
    history: the memory in flight no longer archives the oldest live blocks,
    so it is dropped (nothing was stored) and a new one starts."""

    async def scenario():
        session = Session(store, FakeEngine(window=8192, summary_delay=0.3))
        await session.send(conversation(9))
        edited = conversation(9, chars=901)  # the same steps, other results
        second = await session.send(edited)
        await asyncio.sleep(0.6)
        third = await session.send(edited + conversation(10)[-2:])
        return second, third

    second, third = asyncio.run(scenario())
    assert second.action == "none" and "written ahead" in second.detail
    assert third.action == "compressed" and third.schedule.memory_ahead
    kinds = [e["kind"] for e in asyncio.run(store.events("s1"))]
    assert kinds.count("compression_abandoned") == 1 and kinds.count("compressed") == 1
    assert _ends(asyncio.run(store.events("s1"))) == (2, 2)


def test_a_failed_memory_written_ahead_sends_the_request_append_only(store):
    """The failure is logged and the request goes out as it would with no
    compaction called for: nothing stored, nothing removed."""

    async def scenario():
        session = Session(store, FakeEngine(window=8192, summary_error=RuntimeError("engine down")))
        await session.send(conversation(9))
        await asyncio.sleep(0.1)
        return await session.send(conversation(10))

    out = asyncio.run(scenario())
    assert out.fallback_rule is None and out.messages == conversation(10) and "written ahead" in out.detail
    assert asyncio.run(store.load("s1")).memories == []
    assert _ends(asyncio.run(store.events("s1"))) == (1, 1)


def test_a_conversation_that_outgrew_its_memory_in_flight_compacts_to_fit_the_window(store):
    """The memory in flight archives the blocks that were old at the band's
    top; the conversation grew past the window since, so archiving only those
    would still not fit: it is abandoned and one compaction archives enough."""

    async def scenario():
        session = Session(store, FakeEngine(window=3_000, summary_delay=0.3))
        first = await session.send(conversation(9))
        over = await session.send(conversation(19))  # ~4,400 tokens
        return first, over

    first, over = asyncio.run(scenario())
    assert first.action == "none" and "written ahead" in first.detail
    assert over.action == "compressed" and over.schedule.trigger == "window" and not over.schedule.memory_ahead
    assert FakeEngine().count_tokens(over.messages) < 3_000 and protocol_issues(over.messages) == []
    events = asyncio.run(store.events("s1"))
    assert [e["kind"] for e in events].count("compression_abandoned") == 1
    assert _ends(events) == (2, 2)


def test_a_memory_whose_event_loop_ended_is_abandoned_not_awaited(store):
    """Each request in its own event loop (as a caller of asyncio.run per
    request does): the memory's task is cancelled with its loop, so the next
    request abandons it and starts another, and never raises."""
    session = Session(store, FakeEngine(window=8192, summary_delay=0.3))
    first = asyncio.run(session.send(conversation(9)))
    second = asyncio.run(session.send(conversation(10)))
    assert first.action == second.action == "none" and "written ahead" in second.detail
    kinds = [e["kind"] for e in asyncio.run(store.events("s1"))]
    assert kinds.count("compression_started") == 2 and kinds.count("compression_abandoned") == 1


def test_a_session_dropped_from_the_tracked_ones_has_its_memory_cancelled():
    async def scenario():
        writes = AheadWrites(clock=lambda: 0.0)
        writes._sessions = _InFlight(1)
        first = writes.start("a", ["b1"], "top_of_band", asyncio.sleep(10, result=("text", np.zeros(1))))
        writes.start("b", ["b2"], "top_of_band", asyncio.sleep(0, result=("text", np.zeros(1))))
        await asyncio.sleep(0)
        return first, writes.pending("a")

    first, tracked = asyncio.run(scenario())
    assert first.task.cancelled() and tracked is None


def test_an_unforeseen_error_in_a_compaction_ends_it_with_an_event_and_sends_the_original(store, monkeypatch):
    """Written ahead or inline, a compaction that fails with an error no rule
    names logs ``policy_error`` after its ``compression_started``, and the
    pipeline sends the request whole."""
    from vllm_pamer.core.policies.pamer.compaction_memory import CompactionMemory

    async def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(CompactionMemory, "write", broken)
    for write_ahead, session in ((False, "inline"), (True, "ahead")):

        async def scenario():
            agent = Session(store, FakeEngine(window=8192), write_ahead=write_ahead, session=session)
            outcomes = [await agent.send(conversation(n)) for n in (9, 10, 11, 30)]  # the last: past the window
            return outcomes, await store.events(session)

        outcomes, events = asyncio.run(scenario())
        assert all(o.action != "compressed" for o in outcomes)
        assert outcomes[-1].messages == conversation(30)  # the original, whole
        assert any(o.fallback_rule is not None and o.fallback_rule.value == "policy_error" for o in outcomes)
        started, ends = _ends(events)
        assert started >= 1 and started == ends, [e["kind"] for e in events]


def test_a_failed_memory_written_ahead_then_a_failed_inline_one_end_once_each(store, monkeypatch):
    """The window forces an inline compaction after the memory written ahead
    failed; that one fails too, with an error no rule names: each start has
    exactly one end (the inline one's not logged again by the outer call)."""
    from vllm_pamer.core.fallback import Fallback
    from vllm_pamer.core.policies.pamer.compaction_memory import CompactionMemory
    from vllm_pamer.core.policies.summary_writer import StepFailure

    calls = []

    async def failing(*args, **kwargs):
        calls.append(len(calls))
        if len(calls) == 1:
            raise StepFailure(Fallback.SUMMARY_FAILURE, "the engine refused")
        raise KeyError("a bug")

    monkeypatch.setattr(CompactionMemory, "write", failing)

    async def scenario():
        agent = Session(store, FakeEngine(window=8192))
        await agent.send(conversation(9))  # the band's top: written ahead (and fails)
        await asyncio.sleep(0.05)
        last = await agent.send(conversation(36))  # past the window: waits, then compacts inline
        return last, await store.events("s1")

    last, events = asyncio.run(scenario())
    kinds = [e["kind"] for e in events]
    assert len(calls) == 2 and last.messages == conversation(36), kinds
    assert kinds.count("compression_started") == 2 and _ends(events) == (2, 2), kinds
    assert kinds.count("policy_error") == 1


def test_a_compaction_whose_client_went_away_still_ends_with_an_event(store):
    """vLLM's route cancels the handler when its client disconnects: a
    compaction cancelled while its summary is written logs its end
    (``compression_abandoned``, reason ``cancelled``), inline and written ahead alike."""
    for write_ahead, session in ((False, "inline"), (True, "ahead")):

        async def scenario():
            agent = Session(store, FakeEngine(window=8192, summary_delay=5.0), write_ahead=write_ahead, session=session)
            if write_ahead:
                await agent.send(conversation(9))  # the band's top: the memory is written ahead
                request = asyncio.ensure_future(agent.send(conversation(36)))  # past the window: waits for it
            else:
                request = asyncio.ensure_future(agent.send(conversation(9)))  # compacts inline
            await asyncio.sleep(0.3)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
            return await store.events(session)

        events = asyncio.run(scenario())
        kinds = [e["kind"] for e in events]
        assert _ends(events) == (1, 1), kinds
        assert events[-1]["kind"] == "compression_abandoned" and events[-1]["detail"] == {"reason": "cancelled"}, kinds
