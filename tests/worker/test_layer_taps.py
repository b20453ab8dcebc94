"""Layer taps without an engine: a stand-in model whose layers return vLLM's
``(hidden, residual)`` pairs, fed a step layout like the runner's (requests
in batch order, prompts split over chunks, decode rows in between)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_pamer.adapters.vllm_from_0_32.worker_v1 import V1Step
from vllm_pamer.channel import CaptureRecord
from vllm_pamer.worker.layer_taps import LayerTaps, blocks_at_depths, parse_layers, tap_names

WIDTH = 3


class _Layer(torch.nn.Module):
    """Returns (hidden, residual) whose sum is ``x * scale``: the stream."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * (self.scale - 1), x


class _Norm(torch.nn.Module):
    def forward(self, x):
        return -x, x  # vLLM's fused norm also returns (normed, residual)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([_Layer(2.0), _Layer(3.0)])
        self.model.norm = _Norm()

    def forward(self, x):
        for layer in self.model.layers:
            hidden, residual = layer(x)
            x = hidden + residual
        return self.model.norm(x)[0]


def _step(req_ids, computed, prompts, scheduled, finished=()):
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(
            req_ids=req_ids,
            num_computed_tokens_cpu=np.array(computed),
            num_prompt_tokens=np.array(prompts),
        )
    )
    return runner, SimpleNamespace(num_scheduled_tokens=dict(zip(req_ids, scheduled)), finished_req_ids=set(finished))


def _run(taps, model, step, rows):
    taps.begin_step(V1Step(*step))
    model(rows)
    taps.end_step()


def test_chunked_prompt_gives_last_and_mean_of_every_tap():
    model, taps = _Model(), LayerTaps([1, 2])
    taps.attach(model)
    prompt = torch.arange(5 * WIDTH, dtype=torch.float32).reshape(5, WIDTH)
    decode = torch.full((1, WIDTH), 100.0)
    # step 1: a decoding request "d" first, then the first 3 prompt tokens of "a"
    _run(taps, model, _step(["d", "a"], [9, 0], [4, 5], [1, 3]), torch.cat([decode, prompt[:3]]))
    assert taps.pop("d") is None  # decode rows are never tapped
    # step 2: the last 2 prompt tokens of "a"
    _run(taps, model, _step(["d", "a"], [10, 3], [4, 5], [1, 2]), torch.cat([decode, prompt[3:]]))
    raw, tokens = taps.pop("a")
    assert tokens == 5
    record = CaptureRecord(
        key="k",
        request_id="a",
        session_id=None,
        num_prompt_tokens=5,
        hidden=np.zeros(WIDTH, "<f4").tobytes(),
        layers=raw,
        layer_tokens=tokens,
    )
    last, mean = record.layer_states()
    streams = [prompt * 2, prompt * 6, -prompt * 6]  # block1, block2, norm
    for tap, stream in enumerate(streams):
        assert torch.allclose(torch.from_numpy(last[tap].copy()), stream[-1])
        assert torch.allclose(torch.from_numpy(mean[tap].copy()), stream.mean(dim=0))
    assert taps.pop("a") is None  # read once


def test_taps_are_idle_outside_a_step_and_reset_on_a_fresh_prefill():
    model, taps = _Model(), LayerTaps([2])
    taps.attach(model)
    model(torch.ones(4, WIDTH))  # dummy / profile run: no step armed
    assert taps._pending == {}
    rows = torch.ones(2, WIDTH)
    _run(taps, model, _step(["a"], [0], [4], [2]), rows)
    # preempted and prefilled again from the start: the first pass is dropped
    _run(taps, model, _step(["a"], [0], [4], [2]), rows)
    _run(taps, model, _step(["a"], [2], [4], [2]), rows * 2)
    raw, tokens = taps.pop("a")
    assert tokens == 4
    mean = np.frombuffer(raw, "<f4").reshape(2, 2, WIDTH)[1]
    assert np.allclose(mean[0], 6 * 1.5)  # block2 stream = 6x the mean input 1.5


def test_block_numbers():
    assert parse_layers("8, 4,4") == [4, 8]
    assert parse_layers("") == []
    with pytest.raises(ValueError, match="block numbers"):
        parse_layers("a,b")
    with pytest.raises(ValueError, match="start at 1"):
        parse_layers("0,3")
    assert blocks_at_depths(30) == [4, 8, 15, 22]
    assert blocks_at_depths(2) == [1, 2]
    assert tap_names([4, 8]) == ["block4", "block8", "norm"]
    with pytest.raises(ValueError, match="has 2 layers"):
        LayerTaps([3]).attach(_Model())
