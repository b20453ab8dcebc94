"""Compactions begun and ended, read from a session's store events (``replay/compactions.py``)."""

from __future__ import annotations

import asyncio

import httpx

from vllm_pamer.replay.compactions import EVENTS_READ, compaction_table, read_compactions, tally
from vllm_pamer.replay.records import RunSummary


def _events(*kinds):
    out = []
    for kind in kinds:
        ahead = kind.endswith("+ahead")
        out.append({"kind": kind.removesuffix("+ahead"), "detail": {"ahead": True} if ahead else {}})
    return out


def test_every_start_is_matched_by_its_end():
    events = _events(
        "compression_started",
        "compressed",
        "paged",
        "compression_started+ahead",
        "compression_abandoned",
        "compression_started",
        "summary_failure",
        "policy_error",  # an error outside a compaction ends nothing
    )
    assert tally(events) == {
        "started": 3,
        "compressed": 1,
        "abandoned": 1,
        "failed": 1,
        "in_flight": 0,
        "unended": 0,
        "summaries_after": 0,
        "summaries_added": 0,
        "summaries_not_added": 0,
    }


def test_a_start_without_its_end_is_counted_and_a_memory_written_ahead_at_the_end_is_apart():
    unended = tally(_events("compression_started", "compression_started", "compressed", "compression_started"))
    assert unended["started"] == 3 and unended["unended"] == 2 and unended["compressed"] == 1
    ahead = tally(_events("compression_started", "compressed", "compression_started+ahead"))
    assert ahead["in_flight"] == 1 and ahead["unended"] == 0


def test_summaries_written_after_their_compaction_are_counted_apart():
    after = {"kind": "compressed", "detail": {"summary": "after"}}
    events = [*_events("compression_started"), after, *_events("compression_started"), after]
    events += _events("summary_added", "summary_not_added")
    counts = tally(events)
    assert (counts["started"], counts["compressed"], counts["unended"]) == (2, 2, 0)
    assert (counts["summaries_after"], counts["summaries_added"], counts["summaries_not_added"]) == (2, 1, 1)


def test_the_table_sums_runs_by_policy_and_skips_runs_that_did_not_read_events():
    def run(policy, compactions):
        return RunSummary(policy=policy, trajectories=1, requests=1, elapsed_s=1.0, compactions=compactions)

    one = tally(_events("compression_started", "compressed"))
    table = compaction_table([run("pamer", one), run("pamer", one), run("recent_k", None)])
    assert "| pamer | 2 | 2 | 0 | 0 | 0 | 0 | 0 | 0 | 0 |" in table and "recent_k" not in table
    assert compaction_table([run("recent_k", None)]) == ""


def _read(handler, sessions):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await read_compactions(client, "http://server/", sessions)

    return asyncio.run(go())


def test_sessions_are_read_from_the_route_and_an_unknown_one_had_no_event():
    bodies = {
        "a": {"events": _events("compression_started", "compressed"), "memory_in_flight": None},
        "b": {"events": _events("compression_started+ahead"), "memory_in_flight": {"blocks": 3}},
        "c": {"events": _events("compression_started+ahead"), "memory_in_flight": None},  # dropped by the server
    }

    def handler(request):
        session = request.url.path.rsplit("/", 1)[-1]
        assert request.url.params["events"] == str(EVENTS_READ)
        if session not in bodies:
            return httpx.Response(404, json={"error": {"message": f"no session {session!r}"}})
        return httpx.Response(200, json=bodies[session])

    counts = _read(handler, ["a", "b", "c", "d", "a"])
    ends = {"started": 3, "compressed": 1, "abandoned": 0, "failed": 0, "in_flight": 1, "unended": 1}
    assert counts == {**ends, "summaries_after": 0, "summaries_added": 0, "summaries_not_added": 0}


def test_a_route_that_cannot_be_read_leaves_the_run_without_the_tally():
    def off(request):
        return httpx.Response(404, json={"error": {"message": "the session routes are off on this server"}})

    def timing_out(request):
        raise httpx.ReadTimeout("slow", request=request)

    assert _read(off, ["a"]) is None and _read(timing_out, ["a"]) is None
