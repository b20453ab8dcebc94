"""Interleaved A/B rounds on fresh servers (``benchmarks/_rounds.py``, the
helper the A/B benchmarks share); no server."""

from __future__ import annotations

import pytest

from benchmarks._rounds import abba, interleaved_rounds


def test_ab_rounds_alternate_abba():
    assert abba(1) == [0, 1]
    assert abba(3) == [0, 1, 1, 0, 0, 1]  # each side 3 times, a linear drift shared


class FakeServer:
    def __init__(self, side, events):
        self.side, self.events = side, events

    def wait_ready(self, timeout, progress):
        self.events.append(("ready", self.side))

    def stop(self):
        self.events.append(("stop", self.side))


def test_ab_rounds_collect_each_side_and_stop_every_server():
    events, measured = [], iter(range(100))
    results, logs = interleaved_rounds(
        2,
        lambda side, log: FakeServer(side, events),
        lambda side, server: (side, next(measured)),
        lambda side, result: str(result),
        "ab-test-",
    )
    assert results == [[(0, 0), (0, 3)], [(1, 1), (1, 2)]]  # rounds a b b a
    assert events == [(kind, side) for side in (0, 1, 1, 0) for kind in ("ready", "stop")]
    assert sorted(p.name for p in logs.iterdir()) == ["0", "1", "2", "3"]


def test_ab_rounds_stop_the_server_when_a_round_fails():
    events = []

    def measure(side, server):
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        interleaved_rounds(1, lambda side, log: FakeServer(side, events), measure, str, "ab-test-")
    assert events == [("ready", 0), ("stop", 0)]
