"""Task-grouped splits: every trial of a tau-bench task lies in one split, so
no probe is tested on a task it was trained on (the PaMER paper groups its
splits by question for the same reason): 70/15/15 of all rows per seed, or a
held-out test split (the evaluation split) with train / validation drawn from
the other rows' tasks per seed."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def grouped_split(
    groups: Sequence[str], seed: int, fractions: tuple[float, float, float] = (0.7, 0.15, 0.15)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row indices (train, val, test) with every group in exactly one split.

    The sorted distinct groups are shuffled by ``numpy.random.default_rng(seed)``
    and cut by *group count*: round(0.70 G) train, round(0.15 G) val, the rest
    test (each split gets at least one group when G >= 3). Deterministic per seed."""
    group_array = np.asarray(groups, dtype=object)
    distinct = sorted(set(group_array.tolist()))
    g = len(distinct)
    if g < 3:
        raise ValueError(f"need at least 3 tasks to split 70/15/15, got {g}")
    if not math.isclose(sum(fractions), 1.0):
        raise ValueError(f"fractions must sum to 1: {fractions}")
    order = np.random.default_rng(seed).permutation(g)
    n_train = min(max(1, round(fractions[0] * g)), g - 2)
    n_val = min(max(1, round(fractions[1] * g)), g - n_train - 1)
    index = {distinct[k]: rank for rank, k in enumerate(order)}
    rank = np.fromiter((index[x] for x in group_array), dtype=np.int64, count=len(group_array))
    train = np.flatnonzero(rank < n_train)
    val = np.flatnonzero((rank >= n_train) & (rank < n_train + n_val))
    test = np.flatnonzero(rank >= n_train + n_val)
    return train, val, test


def held_out_split(
    groups: Sequence[str], test: np.ndarray, seed: int, val_share: float = 0.15
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row indices (train, val, test): test is the rows ``test`` marks (the
    evaluation split: the same for every seed); the other rows' tasks are
    shuffled by ``numpy.random.default_rng(seed)`` and round(``val_share`` G)
    of them (at least one, never all) validate, the rest train."""
    test = np.asarray(test, dtype=bool)
    rest = np.flatnonzero(~test)
    distinct = sorted({groups[i] for i in rest})
    if len(distinct) < 2 or not test.any():
        raise ValueError(f"need test rows and at least 2 other tasks, got {int(test.sum())} rows and {len(distinct)}")
    order = np.random.default_rng(seed).permutation(len(distinct))
    n_val = min(max(1, round(val_share * len(distinct))), len(distinct) - 1)
    validating = {distinct[k] for k in order[:n_val]}
    val = np.asarray([i for i in rest if groups[i] in validating], dtype=np.int64)
    train = np.asarray([i for i in rest if groups[i] not in validating], dtype=np.int64)
    return train, val, np.flatnonzero(test)
