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
