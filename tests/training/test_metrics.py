"""The training metrics (``training/metrics.py``) against known values and brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_pamer.training import metrics


def _brute_auroc(y, s):
    pos = [b for a, b in zip(y, s) if a == 1]
    neg = [b for a, b in zip(y, s) if a == 0]
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def _brute_ap(y, s):
    y, s = np.asarray(y), np.asarray(s, dtype=float)
    total, previous_recall = 0.0, 0.0
    for t in sorted(set(s.tolist()), reverse=True):
        predicted = s >= t
        tp = float((predicted & (y == 1)).sum())
        recall = tp / y.sum()
        total += (recall - previous_recall) * tp / predicted.sum()
        previous_recall = recall
    return total


def test_auroc_auprc_known_values():
    # scikit-learn's documented example: roc_auc_score 0.75, average_precision_score 0.8333
    y, s = [0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]
    assert metrics.auroc(y, s) == pytest.approx(0.75)
    assert metrics.auprc(y, s) == pytest.approx(5 / 6)
    # ties: positives (0.5, 0.5) vs negatives (0.5, 0.1): pairs 0.5 + 1 + 0.5 + 1 = 3 of 4
    y, s = [1, 0, 1, 0], [0.5, 0.5, 0.5, 0.1]
    assert metrics.auroc(y, s) == pytest.approx(0.75)
    assert metrics.auprc(y, s) == pytest.approx(2 / 3)  # the tied block enters at once: P = 2/3 at R = 1
    # everything tied: chance AUROC, AP = prevalence
    assert metrics.auroc([1, 0, 0, 1, 0], [3.0] * 5) == pytest.approx(0.5)
    assert metrics.auprc([1, 0, 0, 1, 0], [3.0] * 5) == pytest.approx(0.4)
    # perfect and inverted rankings
    assert metrics.auroc([0, 0, 1], [1, 2, 3]) == 1.0
    assert metrics.auroc([0, 0, 1], [3, 2, 1]) == 0.0
    assert metrics.auprc([0, 0, 1], [1, 2, 3]) == 1.0
    assert metrics.auprc([0, 0, 1], [3, 2, 1]) == pytest.approx(1 / 3)
    # undefined
    assert math.isnan(metrics.auroc([1, 1], [0.1, 0.2]))
    assert math.isnan(metrics.auprc([0, 0], [0.1, 0.2]))
    # invariant to strictly increasing transforms (paper Prop. A.2)
    y, s = [0, 1, 1, 0, 1, 0, 0], np.array([0.2, 0.9, 0.4, 0.4, -1.0, 0.3, 0.9])
    assert metrics.auroc(y, 3 * s + 1) == metrics.auroc(y, s)
    assert metrics.auroc(y, np.exp(s)) == pytest.approx(metrics.auroc(y, s))


def test_auroc_auprc_match_brute_force_with_heavy_ties():
    rng = np.random.default_rng(0)
    for _trial in range(20):
        n = int(rng.integers(5, 60))
        y = rng.integers(0, 2, n)
        if y.min() == y.max():
            y[0] = 1 - y[0]
        s = rng.integers(0, 5, n).astype(float)  # many ties
        assert metrics.auroc(y, s) == pytest.approx(_brute_auroc(y, s), abs=1e-12)
        assert metrics.auprc(y, s) == pytest.approx(_brute_ap(y, s), abs=1e-12)
        fpr, tpr = metrics.roc_curve(y, s)
        assert np.trapezoid(tpr, fpr) == pytest.approx(_brute_auroc(y, s), abs=1e-12)  # ties = diagonal segments


def test_select_threshold_by_f1():
    s = np.array([0.9, 0.8, 0.7, 0.6, 0.2, 0.1])
    y = np.array([1, 1, 0, 1, 0, 0])
    # top-k F1: 2/4, 4/5, 4/6, 6/7, 6/8, 6/9 -> the top 4, threshold between 0.6 and 0.2
    threshold, f1 = metrics.select_threshold(y, s)
    assert threshold == pytest.approx(0.4)
    assert f1 == pytest.approx(6 / 7)
    assert metrics.f1_score(y, s > threshold) == pytest.approx(6 / 7)
    # a tied block is taken or left whole
    threshold, f1 = metrics.select_threshold([1, 0, 0], [0.5, 0.5, 0.1])
    assert threshold == pytest.approx(0.3) and f1 == pytest.approx(2 / 3)
    # everything positive is best: threshold below the lowest score
    threshold, f1 = metrics.select_threshold([1, 1, 0], [2.0, 1.0, 0.0])
    assert threshold == pytest.approx(0.5) and f1 == 1.0
    threshold, f1 = metrics.select_threshold([1, 1, 1], [2.0, 1.0, 0.0])
    assert threshold == pytest.approx(-1.0) and f1 == 1.0
    # equal F1: the higher threshold wins
    threshold, _ = metrics.select_threshold([1, 0, 1, 0], [4.0, 3.0, 2.0, 1.0])  # top1: 2/3, top3: 4/5
    assert threshold == pytest.approx(1.5)


def test_binary_metrics_and_sign_flip():
    out = metrics.binary_metrics([1, 0, 1, 0], [2.0, 1.0, 0.5, -1.0], threshold=0.0)
    assert out["f1"] == pytest.approx(0.8) and out["precision"] == pytest.approx(2 / 3) and out["recall"] == 1.0
    assert metrics.sign_flip_p([0.1, 0.2, 0.05, 0.3, 0.1]) == pytest.approx(2 / 32)
    assert metrics.sign_flip_p([0.1, -0.1]) == 1.0
    assert metrics.mean_sd([1.0, 2.0, 3.0]) == (2.0, 1.0)


def _fold(rng, n_tasks=12, per_task=10, signal_a=2.0, signal_b=0.0):
    groups = np.repeat([f"task{k}" for k in range(n_tasks)], per_task)
    y = rng.integers(0, 2, size=groups.size)
    return metrics.Fold(
        y, y * signal_a + rng.normal(size=y.size), y * signal_b + rng.normal(size=y.size), groups.astype(object)
    )


def test_paired_auroc_test_finds_a_real_difference_and_no_false_one():
    rng = np.random.default_rng(0)
    better = [_fold(rng) for _ in range(5)]
    c = metrics.paired_auroc_test(better, n_boot=500)
    assert c["folds"] == 5 and c["delta"] > 0.3
    assert c["lo"] > 0 and c["p"] < 0.01
    same = [metrics.Fold(f.y, f.scores_a, f.scores_a.copy(), f.groups) for f in better]
    c = metrics.paired_auroc_test(same, n_boot=200)
    assert c["delta"] == 0 and c["p"] == 1.0
    noise = [_fold(rng, signal_a=0.5, signal_b=0.5) for _ in range(5)]
    assert metrics.paired_auroc_test(noise, n_boot=500)["p"] > 0.05


def test_paired_auroc_test_draws_whole_tasks_and_skips_one_class_folds():
    rng = np.random.default_rng(1)
    fold = _fold(rng, n_tasks=12, per_task=20)
    one_class = metrics.Fold(np.ones(4, dtype=int), np.arange(4.0), np.arange(4.0), np.array(["t"] * 4, dtype=object))
    c = metrics.paired_auroc_test([fold, one_class], n_boot=300)
    assert c["folds"] == 1 and c["tasks"] == 12
    assert c["delta"] == pytest.approx(metrics.auroc(fold.y, fold.scores_a) - metrics.auroc(fold.y, fold.scores_b))
    assert math.isnan(metrics.paired_auroc_test([one_class])["delta"])


def test_paired_auroc_test_gives_no_p_on_too_few_tasks_or_draws():
    rng = np.random.default_rng(3)
    few = _fold(rng, n_tasks=metrics.MIN_TASKS - 1)
    c = metrics.paired_auroc_test([few], n_boot=100)
    assert math.isfinite(c["delta"]) and math.isnan(c["p"]) and math.isnan(c["lo"]) and c["tasks"] == 9
    # every positive in one task of ten: a draw without it has one class; one draw may hold none to score
    groups = np.asarray([f"t{k}" for k in range(10) for _ in range(4)], dtype=object)
    y = (groups == "t0").astype(int)
    lonely = metrics.Fold(y, rng.normal(size=40) + y, rng.normal(size=40), groups)
    results = [metrics.paired_auroc_test([lonely], n_boot=1, seed=s) for s in range(20)]
    assert any(math.isnan(r["p"]) for r in results) and any(math.isfinite(r["p"]) for r in results)


def test_paired_auroc_test_moves_folds_over_one_test_split_together():
    # five seeds scored on the same test points are one sample of tasks, not five
    fold = _fold(np.random.default_rng(2), signal_a=1.0, signal_b=0.5)
    one, five = metrics.paired_auroc_test([fold], n_boot=300), metrics.paired_auroc_test([fold] * 5, n_boot=300)
    assert (five["lo"], five["hi"], five["p"]) == (one["lo"], one["hi"], one["p"])


def test_weighted_auroc_is_the_auroc_of_the_points_drawn():
    rng = np.random.default_rng(5)
    y = rng.integers(0, 2, 40)
    scores = np.round(rng.normal(size=40) + y, 1)  # ties, within and across classes
    weights = rng.integers(0, 3, size=(6, 40)).astype(float)
    got = metrics._weighted_auroc(y, scores, weights)
    for row, value in zip(weights.astype(int), got):
        assert value == pytest.approx(metrics.auroc(np.repeat(y, row), np.repeat(scores, row)))
    assert math.isnan(metrics._weighted_auroc(y, scores, (y == 1)[None].astype(float))[0])  # one class drawn
