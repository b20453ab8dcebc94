"""Grouped splits (``training/splits.py``): a task's trajectories stay on one side, deterministically."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vllm_pamer.training.splits import grouped_split, held_out_split
from vllm_pamer.trajectories import task_of


def _grouped_ids(n_tau=40, trials=3, n_swe=60, rows=(1, 9), seed=0):
    rng = np.random.default_rng(seed)
    ids = [f"airline-task{t}-trial{k}" for t in range(n_tau) for k in range(trials)]
    ids += [f"astropy__astropy-{100 + i}" for i in range(n_swe)]
    return [tid for tid in ids for _ in range(int(rng.integers(*rows)))]


def test_grouped_split_keeps_tasks_together_and_is_deterministic():
    trajectory_ids = _grouped_ids()
    groups = [task_of(t) for t in trajectory_ids]
    n_groups = len(set(groups))
    assert n_groups == 100
    splits = {}
    for seed in range(5):
        train, val, test = grouped_split(groups, seed)
        # a partition of the rows
        assert sorted(np.concatenate([train, val, test]).tolist()) == list(range(len(groups)))
        sets = [{groups[i] for i in part} for part in (train, val, test)]
        assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
        # no task (hence no trial of a tau task) crosses splits
        for part, other in itertools.permutations((train, val, test), 2):
            assert not {trajectory_ids[i] for i in part} & {trajectory_ids[i] for i in other}
        assert [len(s) for s in sets] == [70, 15, 15]  # 70/15/15 of the groups
        again = grouped_split(groups, seed)
        assert all(np.array_equal(a, b) for a, b in zip((train, val, test), again))
        splits[seed] = tuple(sorted({groups[i] for i in test}))
    assert len(set(splits.values())) == 5  # seeds give different splits
    # the order of the rows does not matter, only the groups
    shuffled = list(reversed(groups))
    train, _, _ = grouped_split(shuffled, 0)
    assert {shuffled[i] for i in train} == {groups[i] for i in grouped_split(groups, 0)[0]}


def test_grouped_split_small_and_invalid():
    train, val, test = grouped_split(["a", "b", "c"], 0)
    assert len(train) == len(val) == len(test) == 1
    with pytest.raises(ValueError):
        grouped_split(["a", "b", "a"], 0)


def test_held_out_split_tests_the_marked_rows_and_groups_the_rest_by_task():
    groups = [task_of(t) for t in _grouped_ids()]
    test = np.asarray([g.startswith("airline-task1") for g in groups])  # tasks 1, 10-19
    seen_val = set()
    for seed in range(3):
        train, val, tested = held_out_split(groups, test, seed)
        assert np.array_equal(tested, np.flatnonzero(test))  # the same test rows for every seed
        assert sorted(np.concatenate([train, val, tested]).tolist()) == list(range(len(groups)))
        assert not {groups[i] for i in train} & {groups[i] for i in val}
        tasks = {groups[i] for i in np.concatenate([train, val])}
        assert round(0.15 * len(tasks)) == len({groups[i] for i in val})
        seen_val.add(frozenset(groups[i] for i in val))
    assert len(seen_val) == 3  # the seed draws the validation tasks
    with pytest.raises(ValueError, match="test rows"):
        held_out_split(groups, np.zeros(len(groups), dtype=bool), 0)
