"""vllm-pamer train: losses, grouped splits, metrics, export and a small end-to-end run."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.support.training_fixtures import synthetic_states, write_shards
from vllm_pamer.core.heads import ModelFingerprint, load_heads
from vllm_pamer.kernels.five_head_vote import five_head_vote_reference
from vllm_pamer.training import metrics
from vllm_pamer.training.cli import train_main
from vllm_pamer.training.controls import recent2_texts
from vllm_pamer.training.data import StatesError, load_states
from vllm_pamer.training.experiment import TrainConfig, run_experiment
from vllm_pamer.training.probes import (
    FittedHead,
    ProbeHead,
    Standardizer,
    distillation_loss,
    export_head,
    stack_heads,
    weighted_bce,
)
from vllm_pamer.training.splits import grouped_split, task_id


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# --------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------


def test_weighted_bce_hand_values():
    z = torch.tensor([0.0, 2.0, -1.0], dtype=torch.float64)
    y = torch.tensor([1, 0, 1])
    rho = 3.0
    # y=1: rho * -log sigmoid(z) = rho * softplus(-z); y=0: -log(1 - sigmoid(z)) = softplus(z)
    expected = (3.0 * math.log(2.0) + softplus(2.0) + 3.0 * softplus(1.0)) / 3.0
    assert float(weighted_bce(z, y, rho)) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(2.715385, abs=1e-6)


def test_weighted_bce_is_pos_weighted_bce():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(64, generator=gen, dtype=torch.float64) * 4
    y = (torch.rand(64, generator=gen) > 0.7).long()
    for rho in (0.5, 1.0, 2.5):
        p = torch.sigmoid(z)
        definition = -(rho * y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
        assert float(weighted_bce(z, y, rho)) == pytest.approx(float(definition), rel=1e-9)
        ours = weighted_bce(z, y, rho)
        torch_pos_weight = F.binary_cross_entropy_with_logits(
            z, y.double(), pos_weight=torch.tensor(rho, dtype=torch.float64)
        )
        assert float(ours) == pytest.approx(float(torch_pos_weight), rel=1e-9)
    assert float(weighted_bce(torch.tensor([60.0, -60.0]), torch.tensor([1, 0]), 2.0)) < 1e-20  # stable


def test_distillation_hand_values():
    z = torch.tensor([0.0, 2.0, -1.0], dtype=torch.float64)
    y = torch.tensor([1, 0, 1])
    q = torch.tensor([0.9, 0.2, 0.5], dtype=torch.float64)
    rho, lam = 3.0, 0.5
    wbce = (3.0 * math.log(2.0) + softplus(2.0) + 3.0 * softplus(1.0)) / 3.0
    # BCE with a soft target: -(q log p + (1-q) log(1-p)) = softplus(z) - q z
    soft = ((softplus(0.0) - 0.9 * 0.0) + (softplus(2.0) - 0.2 * 2.0) + (softplus(-1.0) + 0.5 * 1.0)) / 3.0
    assert float(distillation_loss(z, y, q, rho, lam)) == pytest.approx(wbce + lam * soft, rel=1e-12)
    assert float(distillation_loss(z, y, q, rho, 0.0)) == pytest.approx(wbce, rel=1e-12)


def test_distillation_matches_paper_identities():
    """Prop. B.1 (l_KD = a * BCE(sigmoid(z), y~)) and the gradient of eq. (26)."""
    gen = torch.Generator().manual_seed(1)
    n = 40
    z = (torch.randn(n, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    y = (torch.rand(n, generator=gen) > 0.6).double()
    q = torch.rand(n, generator=gen, dtype=torch.float64)
    rho, lam = 2.7, 0.5
    loss = distillation_loss(z, y, q, rho, lam)
    loss.backward()
    a = rho * y + 1 - y + lam
    y_soft = (rho * y + lam * q) / a
    per_example = a * F.binary_cross_entropy_with_logits(z.detach(), y_soft, reduction="none")
    assert float(loss.detach()) == pytest.approx(float(per_example.mean()), rel=1e-10)
    expected_grad = (a * torch.sigmoid(z.detach()) - rho * y - lam * q) / n
    torch.testing.assert_close(z.grad, expected_grad, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------
# Grouped splits
# --------------------------------------------------------------------------------------


def test_task_id():
    assert task_id("airline-task14-trial1") == "airline-task14"
    assert task_id("airline-task14-trial12") == "airline-task14"
    assert task_id("retail-task3-trial0") == "retail-task3"
    assert task_id("django__django-14752") == "django__django-14752"
    assert task_id("airline-task14") == "airline-task14"


def _grouped_ids(n_tau=40, trials=3, n_swe=60, rows=(1, 9), seed=0):
    rng = np.random.default_rng(seed)
    ids = [f"airline-task{t}-trial{k}" for t in range(n_tau) for k in range(trials)]
    ids += [f"astropy__astropy-{100 + i}" for i in range(n_swe)]
    return [tid for tid in ids for _ in range(int(rng.integers(*rows)))]


def test_grouped_split_keeps_tasks_together_and_is_deterministic():
    trajectory_ids = _grouped_ids()
    groups = [task_id(t) for t in trajectory_ids]
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


# --------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Export: the heads file reproduces the trained heads through the kernel reference
# --------------------------------------------------------------------------------------


def _random_fitted(kind: str, d: int, seed: int) -> FittedHead:
    torch.manual_seed(seed)
    head = ProbeHead(d, kind)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)  # larger than init, so GELU is far from linear
    rng = np.random.default_rng(seed)
    std = Standardizer(mean=rng.standard_normal(d) * 2, scale=rng.uniform(0.5, 3.0, d))
    return FittedHead(head.eval(), std, best_epoch=1, best_val_loss=0.0)


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_exported_heads_reproduce_trained_logits(kind):
    d = 24
    fitted = [_random_fitted(kind, d, seed) for seed in range(5)]
    exported = [export_head(f) for f in fitted]
    fingerprint = ModelFingerprint("LlamaForCausalLM", d, 2, 100, "tiny")
    thresholds = [0.3, -0.2, 0.0, 1.0, -1.0]
    heads = stack_heads(exported, thresholds, fingerprint, min_votes=3)
    x = np.random.default_rng(9).standard_normal((50, d)).astype(np.float32) * 2 + 1
    expected = np.stack([f.logits(x) for f in fitted], axis=1)
    tensors = [torch.from_numpy(getattr(heads, n)) for n in ("w1", "b1", "w2", "b2", "thresholds")]
    logits, votes, decision = five_head_vote_reference(torch.from_numpy(x), *tensors, min_votes=3)
    assert logits.dtype == torch.float32
    np.testing.assert_allclose(logits.numpy(), expected, rtol=1e-4, atol=1e-4)
    assert np.abs(expected).max() > 1.0  # a meaningful scale
    np.testing.assert_array_equal(votes.numpy(), (logits.numpy() > np.asarray(thresholds, dtype=np.float32)).sum(1))
    assert torch.equal(decision, votes >= 3)
    # float64 through the same reference: the exported (float32) weights are the only rounding
    logits64, _, _ = five_head_vote_reference(torch.from_numpy(x).double(), *[t.double() for t in tensors])
    np.testing.assert_allclose(logits64.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_probe_head_matches_reference_formula():
    """The training module is the kernel's MLP: same GELU (exact erf), same layout."""
    torch.manual_seed(0)
    head = ProbeHead(8, "mlp").double()
    x = torch.randn(5, 8, dtype=torch.float64)
    w1, b1, w2, b2 = head.w1, head.b1, head.w2, head.b2
    stack = lambda t: t.detach()[None].expand(5, *t.shape).contiguous()
    logits, _, _ = five_head_vote_reference(
        x, stack(w1), stack(b1), stack(w2), stack(b2), torch.zeros(5, dtype=torch.float64)
    )
    expected = head(x).detach()
    torch.testing.assert_close(logits, expected[:, None].expand(5, 5), rtol=1e-12, atol=1e-12)
    erf_gelu = 0.5 * (x @ w1 + b1) * (1 + torch.erf((x @ w1 + b1) / math.sqrt(2)))
    torch.testing.assert_close(expected, (erf_gelu @ w2 + b2).detach(), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------
# Texts for the TF-IDF control
# --------------------------------------------------------------------------------------


def test_recent2_texts_are_prefix_plus_two_recent_blocks():
    messages = [
        {"role": "system", "content": "SYSTEM"},
        {"role": "user", "content": "TASK"},
    ]
    for k in range(1, 5):
        messages.append({"role": "assistant", "content": f"ACTION{k}"})
        messages.append({"role": "user", "content": f"RESULT{k}"})
    texts = recent2_texts([{"id": "t-1", "messages": messages}])
    # decision before ACTION4 (message 8): P + blocks 2 and 3; block 1 is old
    text = texts[("t-1", 8)]
    assert "SYSTEM" in text and "TASK" in text and "ACTION2" in text and "RESULT3" in text
    assert "ACTION1" not in text and "ACTION4" not in text
    assert set(texts) == {("t-1", 2), ("t-1", 4), ("t-1", 6), ("t-1", 8)}
    assert "ACTION1" in texts[("t-1", 6)] and texts[("t-1", 2)] == "system: SYSTEM\nuser: TASK"


# --------------------------------------------------------------------------------------
# End to end on synthetic separable data
# --------------------------------------------------------------------------------------


def test_load_states_round_trip_and_completeness(tmp_path):
    full, recent2, meta = synthetic_states(d=8, n_tau=2, n_swe=2)
    write_shards(tmp_path / "s", full, recent2, meta, n_shards=3)
    f2, r2, m2 = load_states(tmp_path / "s")
    np.testing.assert_array_equal(f2, full)
    np.testing.assert_array_equal(r2, recent2)
    assert f2.dtype == r2.dtype == np.float32 and m2 == meta
    # the manifest plans more shards than are complete: refused unless partial
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    (tmp_path / "s" / "manifest.json").write_text(json.dumps({**manifest, "shards": 4}))
    with pytest.raises(StatesError, match="1 of 4 shards are missing"):
        load_states(tmp_path / "s")
    assert len(load_states(tmp_path / "s", allow_partial=True)[2]) == len(meta)
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    # a shard whose JSON lines are not written yet is incomplete
    first = len(meta) - len(np.array_split(np.arange(len(meta)), 3)[2])
    (tmp_path / "s" / "states-00002.jsonl").unlink()
    with pytest.raises(StatesError, match="missing"):
        load_states(tmp_path / "s")
    f3, _, m3 = load_states(tmp_path / "s", allow_partial=True)
    assert len(m3) == first == f3.shape[0] and m3 == meta[:first]
    (tmp_path / "s" / "states-00001.jsonl").write_text(json.dumps(meta[0]) + "\n")
    with pytest.raises(StatesError, match="rows do not match"):
        load_states(tmp_path / "s", allow_partial=True)
    # no shard at all, or no manifest: not an extraction to train on
    for name in ("states-00000.jsonl", "states-00001.jsonl"):
        (tmp_path / "s" / name).unlink()
    with pytest.raises(StatesError, match="no complete shard"):
        load_states(tmp_path / "s", allow_partial=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StatesError, match="manifest"):
        load_states(tmp_path / "empty")


def test_end_to_end_train_writes_loadable_heads(tmp_path):
    d = 16
    full, recent2, meta = synthetic_states(d=d)
    write_shards(tmp_path / "states", full, recent2, meta)
    model = tmp_path / "tiny-model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": d,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 32,
                "vocab_size": 128,
            }
        )
    )
    texts = tmp_path / "texts.jsonl"
    with texts.open("w") as handle:
        for row in meta:
            handle.write(
                json.dumps(
                    {
                        "trajectory_id": row["trajectory_id"],
                        "message_index": row["message_index"],
                        "text": f"tool {row['last_tool']} output step {row['step']}",
                    }
                )
                + "\n"
            )
    out = tmp_path / "heads.safetensors"
    report = tmp_path / "report"
    torch_threads = torch.get_num_threads()
    assert (
        train_main(
            [
                "--states",
                str(tmp_path / "states"),
                "--out",
                str(out),
                "--report",
                str(report),
                "--model",
                str(model),
                "--texts",
                str(texts),
                "--epochs",
                "6",
                "--no-ablations",
            ]
        )
        == 0
    )
    assert torch.get_num_threads() == torch_threads  # restored

    heads = load_heads(out)
    assert heads.trained and heads.min_votes == 3
    assert heads.w1.shape == (5, d, 256)
    heads.check_model(ModelFingerprint("LlamaForCausalLM", d, 2, 128, "tiny-model"))
    results = json.loads((report / "results.json").read_text())
    assert results["data"]["labelled"] == sum(m["compression"] is not None for m in meta) < len(meta)
    assert results["summary"]["full_mlp"]["auroc"][0] > 0.9
    assert results["summary"]["recent2_mlp_kd"]["auroc"][0] > 0.9
    assert "tfidf" in results["summary"]
    assert results["summary"]["metadata"]["auroc"][0] < 0.8  # metadata is noise here
    np.testing.assert_allclose(heads.thresholds, results["thresholds"], rtol=1e-6)
    # the heads file, run through the kernel reference, ranks the labels (every head)
    labelled = [i for i, m in enumerate(meta) if m["compression"] is not None]
    y = np.asarray([meta[i]["compression"] for i in labelled])
    tensors = [torch.from_numpy(getattr(heads, n)) for n in ("w1", "b1", "w2", "b2", "thresholds")]
    logits, _votes, decision = five_head_vote_reference(torch.from_numpy(full[labelled]), *tensors, min_votes=3)
    for h in range(5):
        assert metrics.auroc(y, logits[:, h].numpy()) > 0.9
    assert metrics.f1_score(y, decision.numpy()) > 0.7
    text = (report / "report.md").read_text()
    for needed in ("Beside the paper", "Does the hidden state beat the controls", "Across layers", "0.831", "0.758"):
        assert needed in text
    pytest.importorskip("matplotlib")
    assert (report / "roc.png").stat().st_size > 1000 and (report / "auroc.png").stat().st_size > 1000


def test_run_experiment_ablations_linear_and_student_export():
    full, recent2, meta = synthetic_states(d=8, n_tau=10, n_swe=12, seed=3)
    config = TrainConfig(head="linear", export="student", epochs=2, target="recall")
    result = run_experiment(full, recent2, meta, config, texts=None, log=lambda _: None)
    assert result.export_method == "recent2_linear_kd"
    assert {"full_linear", "full_mlp", "recent2_linear", "recent2_linear_kd", "recent2_linear_kd@full"} <= set(
        result.summary()
    )
    assert "tfidf" not in result.methods and any("TF-IDF skipped" in n for n in result.notes)
    assert len(result.exported) == 5 and len(result.thresholds) == 5
    assert result.data["labelled"] == len(meta)  # recall labelled everywhere here
    for seed in result.seeds:
        assert 0.0 <= seed["methods"]["recent2_linear_kd"]["agreement"] <= 1.0
