"""Compactions begun and ended, read from a session's store events (``replay/compactions.py``)."""

from __future__ import annotations

from vllm_pamer.replay.compactions import compaction_table, tally
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
    }


def test_a_start_without_its_end_is_counted_and_a_memory_written_ahead_at_the_end_is_apart():
    unended = tally(_events("compression_started", "compression_started", "compressed", "compression_started"))
    assert unended["started"] == 3 and unended["unended"] == 2 and unended["compressed"] == 1
    ahead = tally(_events("compression_started", "compressed", "compression_started+ahead"))
    assert ahead["in_flight"] == 1 and ahead["unended"] == 0


def test_the_table_sums_runs_by_policy_and_skips_runs_that_did_not_read_events():
    def run(policy, compactions):
        return RunSummary(policy=policy, trajectories=1, requests=1, elapsed_s=1.0, compactions=compactions)

    one = tally(_events("compression_started", "compressed"))
    table = compaction_table([run("pamer", one), run("pamer", one), run("recent_k", None)])
    assert "| pamer | 2 | 2 | 0 | 0 | 0 | 0 |" in table and "recent_k" not in table
    assert compaction_table([run("recent_k", None)]) == ""
