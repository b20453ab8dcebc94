"""The training commands (``training/cli.py``) without an engine: ``annotate``
writes JSON lines and prints counts; ``train`` on synthetic separable states
writes heads that load and rank the labels, and its report (the layerwise
diagnostic's too). The three commands chained on a real engine:
test_cli_chain.py."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch

from tests.support.training_fixtures import layer_states, synthetic_states, write_shards, write_states_dir
from vllm_pamer.core.heads import ModelFingerprint, load_heads
from vllm_pamer.kernels.five_head_vote import five_head_vote_reference
from vllm_pamer.training import metrics
from vllm_pamer.training.annotate import DecisionPoint, annotate_trajectory, char_counter
from vllm_pamer.training.cli import annotate_main, summarize, train_main
from vllm_pamer.training.data import load_layer_states
from vllm_pamer.trajectories import load_trajectories


def model_config(directory, hidden_size):
    """A model directory holding only the config of a tiny Llama (what ``train --model`` reads)."""
    directory.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "vocab_size": 128,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_cli_writes_json_lines_and_prints_counts(tmp_path, capsys):
    out = tmp_path / "labels.jsonl"
    assert annotate_main(["--limit", "1", "--tokens", "chars", "--out", str(out), "--no-progress"]) == 0
    points = [msgspec.json.decode(line, type=DecisionPoint) for line in out.read_bytes().splitlines()]
    tau, swe = load_trajectories(None, "tau")[0], load_trajectories(None, "swe")[0]
    assert points == annotate_trajectory(tau, char_counter) + annotate_trajectory(swe, char_counter)
    printed = capsys.readouterr().out
    assert f"wrote {len(points)} decision points of 2 trajectories" in printed
    assert "tau-bench/gpt-4o-airline" in printed and "recall_1" in printed
    total = summarize(points)["all"]
    assert total["decisions"] == len(points)
    assert total["gate"] == total["compress_1"] + total["compress_0"]


def test_cli_refuses_an_unknown_annotator(tmp_path):
    with pytest.raises(SystemExit):
        annotate_main(["--annotator", "nope", "--tokens", "chars", "--out", str(tmp_path / "x.jsonl")])


def test_end_to_end_train_writes_loadable_heads(tmp_path):
    d = 16
    full, recent2, meta = synthetic_states(d=d)
    write_shards(tmp_path / "states", full, recent2, meta)
    model = model_config(tmp_path / "tiny-model", hidden_size=d)
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
    assert "Labels by the `reference` annotator: the reference rule's silver labels" in text
    for needed in ("Beside the paper", "Does the hidden state beat the controls", "Across layers", "0.831", "0.758"):
        assert needed in text
    # heads that rank the labels beat noise controls by the paired test on the same test points
    verdict = next(line for line in text.splitlines() if line.startswith("- Hidden, full context, mlp (teacher)"))
    assert "**beats**" in verdict and "paired task bootstrap p = 0.0" in verdict, verdict
    pytest.importorskip("matplotlib")
    assert (report / "roc.png").stat().st_size > 1000 and (report / "auroc.png").stat().st_size > 1000


def test_train_cli_writes_the_layerwise_report(tmp_path):
    last, mean, taps, full, meta = layer_states()
    layers = {"full": full, "recent2": full, "layers_last": last, "layers_mean": mean}
    write_states_dir(tmp_path / "layers", layers, meta, layers=taps)
    write_shards(tmp_path / "states", full, full, meta)
    model = model_config(tmp_path / "model", hidden_size=16)
    report = tmp_path / "report"
    args = [
        "--states",
        str(tmp_path / "states"),
        "--out",
        str(tmp_path / "h.safetensors"),
        "--model",
        str(model),
        "--epochs",
        "5",
        "--no-ablations",
        "--layer-states",
        str(tmp_path / "layers"),
    ]
    with pytest.raises(SystemExit):  # the diagnostic writes into a report
        train_main(args)
    assert train_main(args + ["--report", str(report)]) == 0
    text = (report / "layerwise.md").read_text()
    assert "block 1 (1/2)" in text and "final norm" in text and "Table 9" in text
    assert "[layerwise.md](layerwise.md)" in (report / "report.md").read_text()
    saved = json.loads((report / "layerwise.json").read_text())
    assert saved["taps"] == taps and len(saved["cells"]["recall"]["block1"]["mean"]["auprc"]) == 5
    assert load_layer_states(tmp_path / "layers")[0].shape == last.shape
    pytest.importorskip("matplotlib")
    assert (report / "layerwise.png").stat().st_size > 1000
