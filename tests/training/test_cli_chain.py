"""The three training commands chained as a user runs them, on the shipped
sample trajectories (6 trajectories, 6 tasks) and a tiny random Llama on the
real vLLM engine: ``annotate`` -> ``extract`` -> ``train``; the heads file it
writes loads for that model and reproduces the trained scores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.support.tiny_models import build_tiny_model
from vllm_pamer.core.heads import load_heads
from vllm_pamer.kernels import five_head_vote_reference
from vllm_pamer.model_config import model_fingerprint
from vllm_pamer.training.cli import annotate_main, extract_main, train_main
from vllm_pamer.training.data import load_states

pytestmark = pytest.mark.engine


def test_annotate_extract_train(tmp_path, tokenizer_dir, capsys):
    model = build_tiny_model("llama", tmp_path / "model", tokenizer_dir)
    labels, states, heads, report = (tmp_path / n for n in ("labels.jsonl", "states", "heads.safetensors", "report"))

    assert annotate_main(["--out", str(labels), "--tokenizer", str(model), "--no-progress"]) == 0
    gated = [json.loads(line) for line in labels.read_text().splitlines()]
    gated = [row for row in gated if row["compression"] is not None]
    gated_file = tmp_path / "gated.jsonl"
    gated_file.write_text("".join(json.dumps(row) + "\n" for row in gated))

    assert (
        extract_main(
            [
                "--labels",
                str(gated_file),
                "--out",
                str(states),
                "--model",
                str(model),
                "--max-model-len",
                "2048",
                "--gpu-memory-utilization",
                "0.15",
                "--shard-size",
                "64",
                "--no-progress",
            ]
        )
        == 0
    )
    full, _, meta = load_states(states)
    assert len(meta) == len(gated) and full.shape == (len(gated), 128)

    assert (
        train_main(
            [
                "--states",
                str(states),
                "--out",
                str(heads),
                "--report",
                str(report),
                "--model",
                str(model),
                "--epochs",
                "5",
                "--no-ablations",
            ]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    loaded = load_heads(heads)
    loaded.check_model(model_fingerprint(model))
    assert loaded.trained and loaded.w1.shape == (5, 128, 256)
    assert (report / "report.md").exists() and json.loads((report / "results.json").read_text())["data"]["rows"] == len(
        meta
    )
    tensors = [torch.from_numpy(getattr(loaded, n)) for n in ("w1", "b1", "w2", "b2", "thresholds")]
    logits, _, _ = five_head_vote_reference(torch.from_numpy(full), *tensors, min_votes=3)
    assert torch.isfinite(logits).all() and np.unique(logits[:, 0].numpy()).size > 1  # the heads read the states
