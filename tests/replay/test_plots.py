"""What the replay's plots draw (``replay/plots.py``)."""

from __future__ import annotations

from tests.support.replay import RECORDS
from vllm_pamer.replay.plots import context_per_turn, per_step


def test_context_per_turn():
    curves = context_per_turn(RECORDS)
    assert curves["none"] == {0: 200, 1: 200}  # mean of A/0 and B/0; B/1 was refused
    assert curves["recent_k"] == {0: 175, 1: 205}


def test_latency_per_step_is_the_mean_of_the_answered_requests():
    curves = per_step(RECORDS, lambda r: r.latency_s)
    answered = [r for r in RECORDS if r.policy == "none" and r.step == 1 and r.status == "ok"]
    assert curves["none"][1] == sum(r.latency_s for r in answered) / len(answered)
    assert set(curves) == {r.policy for r in RECORDS}
