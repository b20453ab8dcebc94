"""The training experiment (``training/experiment.py``): the ablations, a linear head and the student export."""

from __future__ import annotations

from tests.support.training_fixtures import synthetic_states
from vllm_pamer.training.experiment import TrainConfig, run_experiment


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
