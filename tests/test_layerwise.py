"""The depth diagnostic on synthetic layer states with a known answer: the
signal sits in the last-token state of the final norm, weakly in block 1's,
and nowhere in the means; recall is noise."""

from __future__ import annotations

import json

import pytest

from tests.support.training_fixtures import layer_states, write_shards, write_states_dir
from vllm_pamer.training.cli import train_main
from vllm_pamer.training.data import load_layer_states
from vllm_pamer.training.layerwise import run_layerwise


def test_layerwise_finds_the_layer_and_pooling_that_carry_the_signal():
    last, mean, taps, _, meta = layer_states()
    result = run_layerwise(last, mean, taps, meta, num_layers=2, log=lambda _: None, progress=False)
    auroc = {(tap, p): result.summary("compression", tap, p)[0] for tap in taps for p in ("last", "mean")}
    assert auroc[("norm", "last")] > 0.9
    assert 0.6 < auroc[("block1", "last")] < auroc[("norm", "last")]
    assert abs(auroc[("norm", "mean")] - 0.5) < 0.15 and abs(auroc[("block1", "mean")] - 0.5) < 0.15
    gap = result.summary("compression", "norm", "last", "gap")[0]
    assert gap > 1.0 > abs(result.summary("compression", "norm", "mean", "gap")[0])
    assert abs(result.summary("recall", "norm", "last")[0] - 0.5) < 0.15  # recall labels are noise here
    assert len(result.cells["compression"]["norm"]["last"]["auroc"]) == 5  # one per seed


def test_train_cli_writes_the_layerwise_report(tmp_path):
    last, mean, taps, full, meta = layer_states()
    layers = {"full": full, "recent2": full, "layers_last": last, "layers_mean": mean}
    write_states_dir(tmp_path / "layers", layers, meta, layers=taps)
    write_shards(tmp_path / "states", full, full, meta)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 16,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 32,
                "vocab_size": 128,
            }
        )
    )
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
