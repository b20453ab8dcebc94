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
