"""Ranking and thresholded metrics for the memory heads (paper Appendix A.2).

Pure numpy, no scikit-learn. Ties are handled exactly:

* ``auroc`` is the Mann-Whitney statistic of paper eq. (15): a tied
  positive-negative pair counts 1/2 (average ranks);
* ``auprc`` is average precision, ``sum_j (R_j - R_{j-1}) P_j`` over the
  *distinct* scores taken as thresholds from high to low (tied scores enter
  together), the same definition as scikit-learn's ``average_precision_score``;
* ``select_threshold`` picks the validation-F1-best threshold and returns it in
  the strict ``score > threshold`` form the heads kernel uses
  (``kernels.five_head_vote_reference`` votes ``logits > thresholds``).

Every function returns ``nan`` where a metric is undefined (no positive or no
negative), never raises for that.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


def _as_arrays(y, scores) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(y).astype(np.int64).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    if y.shape != scores.shape:
        raise ValueError(f"labels {y.shape} and scores {scores.shape} differ in length")
    if not np.isin(y, (0, 1)).all():
        raise ValueError("labels must be 0/1")
    return y, scores


def average_ranks(scores) -> np.ndarray:
    """1-based ranks of ``scores`` (ascending); tied scores share their mean rank."""
    scores = np.asarray(scores, dtype=np.float64).ravel()
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    last = np.cumsum(counts)  # rank of the last member of each tie group
    mean_rank = last - (counts - 1) / 2.0
    return mean_rank[inverse]


def auroc(y, scores) -> float:
    """Area under the ROC curve = P(score+ > score-) + 1/2 P(tie)."""
    y, scores = _as_arrays(y, scores)
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = average_ranks(scores)
    return float((ranks[y == 1].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _distinct_threshold_counts(y: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct scores from high to low, with the cumulative true and false
    positives when predicting positive for ``score >= that score``."""
    order = np.argsort(-scores, kind="mergesort")
    s, yy = scores[order], y[order]
    last_of_group = np.r_[np.flatnonzero(np.diff(s) != 0), s.size - 1]
    tp = np.cumsum(yy)[last_of_group]
    fp = (last_of_group + 1) - tp
    return s[last_of_group], tp.astype(np.float64), fp.astype(np.float64)


def auprc(y, scores) -> float:
    """Average precision (area under the precision-recall step curve)."""
    y, scores = _as_arrays(y, scores)
    n_pos = int(y.sum())
    if n_pos == 0 or y.size == 0:
        return float("nan")
    _, tp, fp = _distinct_threshold_counts(y, scores)
    precision = tp / (tp + fp)
    recall = tp / n_pos
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def roc_curve(y, scores) -> tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) from (0, 0) to (1, 1), one point per distinct score."""
    y, scores = _as_arrays(y, scores)
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return np.array([0.0, 1.0]), np.array([0.0, 1.0])
    _, tp, fp = _distinct_threshold_counts(y, scores)
    return np.r_[0.0, fp / n_neg], np.r_[0.0, tp / n_pos]


def f1_score(y, predicted) -> float:
    """F1 of binary predictions (0 when there is no true positive)."""
    y = np.asarray(y).astype(bool).ravel()
    predicted = np.asarray(predicted).astype(bool).ravel()
    tp = float(np.sum(y & predicted))
    denominator = float(y.sum() + predicted.sum())
    return 0.0 if tp == 0 else 2.0 * tp / denominator


def select_threshold(y, scores) -> tuple[float, float]:
    """Validation-F1-best threshold (paper eq. 14), as ``(threshold, f1)``.

    Predictions are ``scores > threshold``. Candidates are "positive for the
    top j distinct scores" for every j; the returned threshold lies halfway
    between the j-th distinct score and the next lower one (1.0 below the
    lowest score when every row is predicted positive), so that it works the
    same for ``>=`` on the validation scores and generalizes symmetrically.
    Among equal F1 values the highest threshold (fewest positives) wins. With
    no positive in ``y`` every F1 is 0 and the threshold sits just below the
    top score."""
    y, scores = _as_arrays(y, scores)
    if y.size == 0:
        return 0.0, 0.0
    distinct, tp, fp = _distinct_threshold_counts(y, scores)
    n_pos = float(y.sum())
    f1 = np.where(tp > 0, 2.0 * tp / np.maximum(tp + fp + n_pos, 1.0), 0.0)
    best = int(np.argmax(f1))  # first maximum = highest threshold
    if best + 1 < distinct.size:
        threshold = 0.5 * (distinct[best] + distinct[best + 1])
    else:
        threshold = distinct[best] - 1.0
    return float(threshold), float(f1[best])


def binary_metrics(y, scores, threshold: float) -> dict[str, float]:
    """AUROC, AUPRC and F1/precision/recall of ``scores > threshold``."""
    y, scores = _as_arrays(y, scores)
    predicted = scores > threshold
    tp = float(np.sum(predicted & (y == 1)))
    return {
        "auroc": auroc(y, scores),
        "auprc": auprc(y, scores),
        "f1": f1_score(y, predicted),
        "precision": tp / predicted.sum() if predicted.sum() else float("nan"),
        "recall": tp / y.sum() if y.sum() else float("nan"),
        "positive_rate": float(y.mean()) if y.size else float("nan"),
        "n": int(y.size),
    }


def mean_sd(values) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1) of the finite values."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def sign_flip_p(differences) -> float:
    """Two-sided paired sign-flip p-value (paper eq. 21): the share of the 2^S
    sign patterns whose mean has |mean| >= |observed mean|."""
    d = np.asarray([x for x in differences if math.isfinite(x)], dtype=np.float64)
    if d.size == 0:
        return float("nan")
    observed = abs(d.mean())
    hits = 0
    for signs in itertools.product((-1.0, 1.0), repeat=d.size):
        hits += abs(float(np.mean(np.asarray(signs) * d))) >= observed - 1e-12
    return hits / 2**d.size


BOOT_DRAWS = 2000
"""Draws of the paired task bootstrap."""
MIN_TASKS = 10
"""Tasks below which the paired test gives no interval or p: a bootstrap over
a handful of clusters reads far too sure."""


class Fold(NamedTuple):
    """One split's test points, scored by two methods: the unit of the paired test."""

    y: np.ndarray
    scores_a: np.ndarray
    scores_b: np.ndarray
    groups: np.ndarray
    """Each point's task: the bootstrap draws whole tasks, as the split does."""


def _weighted_auroc(y: np.ndarray, scores: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUROC of ``scores`` under each row of ``weights`` ([draws, n]: how many
    times each point is drawn), ties counting 1/2; nan where a draw lacks a class."""
    order = np.argsort(scores, kind="mergesort")
    s, pos = scores[order], y[order] == 1
    w = weights[:, order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # tie groups, ascending
    w_pos = np.add.reduceat(np.where(pos, w, 0.0), starts, axis=1)
    w_neg = np.add.reduceat(np.where(pos, 0.0, w), starts, axis=1)
    below = np.cumsum(w_neg, axis=1) - w_neg  # negative weight under each group
    total = w_pos.sum(1) * w_neg.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (w_pos * (below + 0.5 * w_neg)).sum(1) / total, np.nan)


def paired_auroc_test(folds: Sequence[Fold], n_boot: int = BOOT_DRAWS, seed: int = 0) -> dict[str, float]:
    """AUROC(a) - AUROC(b) on the same test points, averaged over the folds
    (seeds), with a 95% interval and a two-sided p from a task bootstrap:
    each draw resamples the tasks of all folds together with replacement
    (a task drawn twice counts twice, in every fold that tests it: folds over
    one test split move together) and scores both methods on the same draw,
    so the pairing is kept. Unlike the sign-flip test over five seeds, whose
    p cannot fall below 2/32, it reads the test points' spread. A fold, or a
    draw of it, with one class only is left out; ``delta`` is nan when no
    fold has both classes, the interval and p when fewer than ``MIN_TASKS``
    tasks are tested. It reads the test points given these heads: the
    spread of training (other seeds) is the folds' to show."""
    pairs = [(f, auroc(f.y, f.scores_a) - auroc(f.y, f.scores_b)) for f in folds if len(f.y)]
    folds = [f for f, d in pairs if math.isfinite(d)]  # a fold of one class has one in every draw too
    observed = [d for _, d in pairs if math.isfinite(d)]
    tasks = {t: k for k, t in enumerate(sorted({str(g) for f in folds for g in f.groups}))}
    out = {"delta": float(np.mean(observed)) if observed else math.nan, "folds": len(observed), "tasks": len(tasks)}
    if len(tasks) < MIN_TASKS:
        return {**out, "lo": math.nan, "hi": math.nan, "p": math.nan}
    rng = np.random.default_rng(seed)
    counts = np.stack(
        [np.bincount(rng.integers(0, len(tasks), len(tasks)), minlength=len(tasks)) for _ in range(n_boot)]
    )
    deltas = []
    for f in folds:
        weights = counts[:, [tasks[str(g)] for g in f.groups]].astype(np.float64)
        y = np.asarray(f.y).astype(np.int64)
        a, b = np.asarray(f.scores_a, np.float64), np.asarray(f.scores_b, np.float64)
        deltas.append(_weighted_auroc(y, a, weights) - _weighted_auroc(y, b, weights))
    stack = np.stack(deltas)
    finite = np.isfinite(stack)
    scored = finite.sum(0)  # folds with both classes in each draw
    draws = np.where(finite, stack, 0.0).sum(0)[scored > 0] / scored[scored > 0]
    if not draws.size:  # no draw kept both classes anywhere
        return {**out, "lo": math.nan, "hi": math.nan, "p": math.nan}
    below, above = int((draws <= 0).sum()), int((draws >= 0).sum())
    return {
        **out,
        "lo": float(np.percentile(draws, 2.5)),
        "hi": float(np.percentile(draws, 97.5)),
        "p": min(1.0, 2 * (min(below, above) + 1) / (draws.size + 1)),
    }
