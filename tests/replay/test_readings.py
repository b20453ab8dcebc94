"""A replay's evidence by the one rule (replay/readings.py, replay/report.py: the
readable and observed shares, refusals reading nothing, common requests),
on synthetic records with known values."""

from __future__ import annotations

import pytest

from vllm_pamer.replay.readings import add_common
from vllm_pamer.replay.records import RunSummary, StepRecord
from vllm_pamer.replay.report import evidence_table, summarize


def rec(policy, trajectory, step, *, needs=0, readable=None, observed=None, status="ok"):
    return StepRecord(
        policy=policy,
        trajectory_id=trajectory,
        session_id=f"{policy}-{trajectory}",
        step=step,
        message_index=2 * step + 2,
        status=status,
        latency_s=1.0,
        needs=needs,
        readable=readable if status == "ok" else None,
        observed=observed if status == "ok" else None,
        chars_sent=50 if status == "ok" else None,
        chars_original=100,
    )


def run(policy):
    return RunSummary(policy=policy, trajectories=1, requests=3, elapsed_s=60.0)


RECORDS = [
    # none: refuses the last request (beyond the window), reads all else
    rec("none", "t", 0, needs=2, readable=2, observed=2),
    rec("none", "t", 1, needs=2, readable=2, observed=2),
    rec("none", "t", 2, needs=4, status="beyond_window"),
    # pamer: answers all; keeps what it archived readable through its record's call lines only
    rec("pamer", "t", 0, needs=2, readable=2, observed=2),
    rec("pamer", "t", 1, needs=2, readable=2, observed=1),
    rec("pamer", "t", 2, needs=4, readable=3, observed=1),
]


def test_a_refused_request_reads_none_of_its_needs_and_common_requests_leave_it_out():
    rows = {row.policy: row for row in summarize(RECORDS, [run("none"), run("pamer")])}
    assert (rows["none"].needs, rows["pamer"].needs) == (8, 8)
    assert rows["none"].readable == pytest.approx(4 / 8) and rows["none"].observed == pytest.approx(4 / 8)
    assert rows["pamer"].readable == pytest.approx(7 / 8) and rows["pamer"].observed == pytest.approx(4 / 8)
    add_common(list(rows.values()), RECORDS)
    assert rows["none"].common == rows["pamer"].common == 2  # the request none refused is left out
    assert rows["none"].readable_common == 1.0 and rows["pamer"].readable_common == 1.0
    assert rows["pamer"].observed_common == pytest.approx(3 / 4) and rows["none"].observed_common == 1.0


def test_the_evidence_table_names_its_columns():
    rows = summarize(RECORDS, [run("none"), run("pamer")])
    add_common(rows, RECORDS)
    header, _, *lines = evidence_table(rows).split("\n")
    titles = [t.strip() for t in header.strip("|").split("|")]
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in lines}
    column = {title: i for i, title in enumerate(titles)}
    assert cells["pamer"][column["readable"]] == "87.5%" and cells["pamer"][column["observed"]] == "50.0%"
    assert cells["none"][column["refused"]] == "1" and cells["none"][column["common requests"]] == "2"


def test_prefill_on_common_requests_leaves_out_what_the_others_computed():
    """A policy's prefill on the requests every policy answered: its whole
    computed prefill (internal requests included) less the prompt tokens its
    other answered requests did not get from the prefix cache."""
    records = [
        rec("none", "t", 0, needs=1, readable=1),
        rec("none", "t", 1, needs=1, status="beyond_window"),
        rec("pamer", "t", 0, needs=1, readable=1),
        rec("pamer", "t", 1, needs=1, readable=1),
    ]
    for r, (prompt, cached) in zip(records, [(100, 0), (None, None), (100, 0), (900, 200)]):
        r.usage_prompt_tokens, r.cached_tokens = prompt, cached
    rows = {row.policy: row for row in summarize(records, [run("none"), run("pamer")])}
    rows["none"].prefill_computed, rows["pamer"].prefill_computed = 100.0, 1300.0  # pamer: 300 of a summary
    add_common(list(rows.values()), records)
    assert rows["none"].prefill_common == 100.0
    assert rows["pamer"].prefill_common == 1300.0 - (900 - 200)
    records[3].cached_tokens = None  # unknown: no figure rather than a wrong one
    add_common(list(rows.values()), records)
    assert rows["pamer"].prefill_common is None
