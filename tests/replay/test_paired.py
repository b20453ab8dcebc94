"""One policy against another, request by request (replay/paired.py): the
differences on the requests both answered, their trajectory-bootstrap
intervals, refusals left out, on synthetic records with known values."""

from __future__ import annotations

import msgspec
import pytest

from tests.support.replay import rec as support_rec
from vllm_pamer.replay.paired import paired_rows, paired_table
from vllm_pamer.replay.records import PolicyRow


def rec(policy, trajectory, step, *, needs, readable, logprob=None, status="ok"):
    answered = status == "ok"
    return msgspec.structs.replace(
        support_rec(policy, trajectory, step, 100, status=status),
        needs=needs,
        readable=readable if answered else None,
        observed=readable if answered else None,
        action_logprob=logprob if answered else None,
    )


def row(policy, prefill):
    return PolicyRow(
        policy=policy, trajectories=1, requests=1, answered=1, beyond_window=0, errors=0, prefill_computed=prefill
    )


def test_the_differences_are_on_the_requests_both_answered_with_intervals_over_trajectories():
    records = []
    for t in ("a", "b", "c", "d"):
        for step in range(3):
            records.append(rec("pamer", t, step, needs=4, readable=3, logprob=-1.0))
            records.append(rec("band_top", t, step, needs=4, readable=2, logprob=-1.5))
    records.append(rec("pamer", "a", 3, needs=10, readable=10, logprob=0.0))
    records.append(rec("band_top", "a", 3, needs=10, readable=0, status="beyond_window"))  # left out
    [p] = paired_rows("pamer", [row("pamer", 110.0), row("band_top", 100.0)], records)
    assert (p.other, p.trajectories, p.requests, p.one_sided, p.needs, p.scored) == ("band_top", 4, 12, 1, 48, 12)
    assert p.readable == pytest.approx(0.25) and p.readable_ci == pytest.approx((0.25, 0.25))  # the same everywhere
    assert p.logprob == pytest.approx(0.5) and p.prefill_ratio == pytest.approx(1.1)
    table = paired_table([p])
    assert "| pamer | band_top | 4 | 12 | 1 | 48 | +25.0 pt (+25.0 to +25.0) |" in table and "+0.500" in table


def test_an_interval_widens_with_what_differs_between_trajectories():
    records = []
    for t, mine in (("a", 4), ("b", 0), ("c", 4), ("d", 0), ("e", 2)):
        records.append(rec("pamer", t, 0, needs=4, readable=mine))
        records.append(rec("random", t, 0, needs=4, readable=2))
    [p] = paired_rows("pamer", [row("pamer", None), row("random", None)], records)
    assert p.readable == pytest.approx(0.0) and p.readable_ci[0] < -0.1 < 0.1 < p.readable_ci[1]
    assert p.logprob is None and p.prefill_ratio is None and paired_table([p]).endswith("| 0 | - | - |")
