"""What the replay's plots draw (``replay/plots.py``)."""

from __future__ import annotations

from tests.support.replay import RECORDS
from vllm_pamer.replay.plots import context_per_turn


def test_context_per_turn():
    curves = context_per_turn(RECORDS)
    assert curves["none"] == {0: 200, 1: 200}  # mean of A/0 and B/0; B/1 was refused
    assert curves["recent_k"] == {0: 175, 1: 205}
