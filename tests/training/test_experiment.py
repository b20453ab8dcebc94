"""The training experiment (``training/experiment.py``): the ablations, a linear head and the student export."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.training_fixtures import synthetic_states
from vllm_pamer.training.experiment import TrainConfig, run_experiment
from vllm_pamer.training.metrics import f1_score
from vllm_pamer.training.report import write_report
from vllm_pamer.trajectories import split_of


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


def test_run_experiment_without_recent2_trains_the_full_context_heads_alone(tmp_path):
    full, _, meta = synthetic_states(d=8, n_tau=10, n_swe=12, seed=3)
    config = TrainConfig(epochs=2, target="recall", seeds=(0, 1))
    result = run_experiment(full, None, meta, config, texts=None, log=lambda _: None)
    assert result.export_method == "full_mlp" and len(result.exported) == 2
    assert {"full_mlp", "full_linear", "metadata"} <= set(result.summary())
    assert not any(key.startswith("recent2") for key in result.methods)
    report = write_report(result, tmp_path).read_text()
    assert "extracted without Recent2" in report and "Decision distillation" not in report
    with pytest.raises(ValueError, match="Recent2"):
        run_experiment(full, None, meta, TrainConfig(export="student", epochs=1), texts=None, log=lambda _: None)


def test_held_out_tests_every_seed_on_the_evaluation_split_and_scores_the_vote(tmp_path):
    full, recent2, meta = synthetic_states(d=8, n_tau=16, n_swe=6, seed=4)
    config = TrainConfig(epochs=3, held_out=True, ablations=False, seeds=(0, 1, 2), export="student")
    result = run_experiment(full, recent2, meta, config, texts=None, log=lambda _: None)
    tested = [sorted(set(s["test_groups"])) for s in result.seeds]
    for other in result.seeds[1:]:  # one test split for every seed, row for row
        assert np.array_equal(other["test_groups"], result.seeds[0]["test_groups"])
        assert np.array_equal(other["test_labels"], result.seeds[0]["test_labels"])
    assert all(split_of({"id": f"{task}-trial0"}) == "evaluation" for task in tested[0] if task.startswith("airline"))
    assert "django__django-1000" in tested[0]  # a task the split file does not name is evaluation
    report = write_report(result, tmp_path).read_text()
    assert "test: the evaluation split's rows" in report
    vote = next(line for line in report.splitlines() if "vote of the exported heads" in line)
    y = result.seeds[0]["test_labels"]
    scores = [s["methods"]["recent2_mlp_kd@full"]["test_scores"] for s in result.seeds]  # the student as served
    unanimous = np.all([z > t for z, t in zip(scores, result.thresholds)], axis=0)
    assert "3-of-3 vote" in vote and f"F1 {f1_score(y, unanimous):.3f}" in vote, vote
