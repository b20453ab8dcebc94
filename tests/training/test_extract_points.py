"""Which decision points an extraction takes (``training/extract.py``, its point selection); no engine."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_pamer.training.extract import select_trajectories

SIZES = {"a": 5, "b": 1, "c": 7, "d": 2}


def _points() -> list:
    return [SimpleNamespace(label=SimpleNamespace(trajectory_id=t)) for t, n in SIZES.items() for _ in range(n)]


def test_select_trajectories_takes_every_point_of_drawn_trajectories_in_order():
    points = _points()
    chosen = select_trajectories(points, 6, seed=0)
    ids = [p.label.trajectory_id for p in chosen]
    assert len(chosen) >= 6 and chosen == [p for p in points if p.label.trajectory_id in set(ids)]  # data order
    assert all(ids.count(t) == SIZES[t] for t in set(ids))  # whole trajectories
    assert len(set(ids)) < 4  # it stops once 6 are taken (never needs all four here)
    assert select_trajectories(points, 6, seed=0) == chosen  # seeded
    assert {p.label.trajectory_id for p in select_trajectories(points, 100, seed=1)} == set(SIZES)
