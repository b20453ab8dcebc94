"""The depth diagnostic (``training/layerwise.py``) on synthetic layer states
with a known answer: the signal sits in the last-token state of the final
norm, weakly in block 1's, and nowhere in the means; recall is noise."""

from __future__ import annotations

from tests.support.training_fixtures import layer_states
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
