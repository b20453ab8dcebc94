"""five_head_vote on the torch path (the CPU path and the oracle of the Triton
kernel) against the float64 numpy oracle, dispatch, and (with a GPU) the
Triton kernel on CUDA. In fresh processes
(``tests/support/kernels/fresh_process.py``): the Triton kernel on CPU under
the Triton interpreter (``interp_five_head_vote.py``), and compiled for NVIDIA
GPUs."""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.kernels.fresh_process import check_compiles_without_spills, run_interpreted
from tests.support.kernels.oracles import check_vote, vote_problem
from vllm_pamer.core.heads import NUM_HEADS, ModelFingerprint, random_heads
from vllm_pamer.kernels import FiveHeadVote, five_head_vote, five_head_vote_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("d", [576, 4096])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_reference_matches_float64(batch, d, x_dtype):
    args, logits64 = vote_problem(batch, d, x_dtype=DTYPES[x_dtype], seed=batch * 7919 + d)
    for min_votes in (1, 3, 5):
        checked = check_vote(five_head_vote_reference(*args, min_votes), logits64, args[5], min_votes)
        # rows whose logits all clear their thresholds have their votes checked exactly: nearly all here
        assert checked >= max(1, batch - batch // 4), checked


def test_reference_large_batch_and_float64():
    args, logits64 = vote_problem(1024, 576, seed=1)
    check_vote(five_head_vote_reference(*args, 3), logits64, args[5], 3)
    logits, _votes, _ = five_head_vote_reference(*(t.double() for t in args), 3)
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, torch.from_numpy(logits64), rtol=1e-12, atol=1e-12)


def test_dispatch_on_cpu_is_the_reference():
    args, _ = vote_problem(7, 576, x_dtype=torch.bfloat16, seed=2)
    for got, want in zip(five_head_vote(*args, min_votes=2), five_head_vote_reference(*args, min_votes=2)):
        assert torch.equal(got, want)


def test_held_heads_on_cpu_are_the_reference():
    args, _ = vote_problem(7, 576, x_dtype=torch.bfloat16, seed=3)
    held = FiveHeadVote(*args[1:], min_votes=3, device="cpu")
    for got, want in zip(held(args[0]), five_head_vote_reference(*args, min_votes=3)):
        assert torch.equal(got, want)
    # bf16 heads: the reference over the rounded weights
    held16 = FiveHeadVote(*args[1:], min_votes=3, device="cpu", bf16_heads=True)
    assert held16.w1_bf16 is not None and held16.w1_bf16.dtype == torch.bfloat16
    rounded = (args[0], args[1].bfloat16(), *args[2:])
    for got, want in zip(held16(args[0]), five_head_vote_reference(*rounded, min_votes=3)):
        assert torch.equal(got, want)


def test_cpu_paths_never_import_triton():
    """CPU-only installs (the vLLM CPU worker) must not pay for triton."""
    code = (
        "import sys, torch, vllm_pamer.kernels as kernels\n"
        "x = torch.randn(3, 64); w1 = torch.randn(5, 64, 256)\n"
        "kernels.five_head_vote(x, w1, torch.randn(5, 256), torch.randn(5, 256), torch.randn(5), torch.zeros(5))\n"
        "kernels.cosine_topk(torch.randn(2, 64), torch.tensor([1, 2]), torch.randn(9, 64), torch.ones(9).long(), 3)\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


# the reference on random heads files' weights (core/heads.py), against float64
# with GELU's erf written out, one head at a time


def _independent_logits(x, w1, b1, w2, b2) -> np.ndarray:
    """float64, one head at a time, GELU written out with erf."""
    x64 = x.astype(np.float64)
    out = np.empty((x.shape[0], w1.shape[0]))
    erf = np.vectorize(math.erf)
    for h in range(w1.shape[0]):
        z = x64 @ w1[h].astype(np.float64) + b1[h].astype(np.float64)
        g = 0.5 * z * (1.0 + erf(z / math.sqrt(2.0)))
        out[:, h] = g @ w2[h].astype(np.float64) + float(b2[h])
    return out


def _random_problem(batch: int, d: int, seed: int):
    rng = np.random.default_rng(seed)
    fp = ModelFingerprint("LlamaForCausalLM", d, 2, 100)
    heads = random_heads(fp, seed=seed)
    x = rng.standard_normal((batch, d)).astype(np.float32)
    x[x == 0] = 0.5  # non-zero inputs
    logits64 = _independent_logits(x, heads.w1, heads.b1, heads.w2, heads.b2)
    # thresholds spread over the logits' range, so votes take several values
    thresholds = (rng.standard_normal(NUM_HEADS) * logits64.std() * 0.5 + logits64.mean()).astype(np.float32)
    return x, heads, thresholds, logits64


@pytest.mark.parametrize("d", [64, 576])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_five_head_vote_reference_matches_float64(batch, d):
    x, heads, thresholds, expected = _random_problem(batch, d, seed=batch * 1000 + d)
    args = [torch.from_numpy(a) for a in (x, heads.w1, heads.b1, heads.w2, heads.b2, thresholds)]
    clear = (np.abs(expected - thresholds.astype(np.float64)) > 1e-4).all(axis=1)
    assert clear.any()
    expected_votes = (expected > thresholds.astype(np.float64)).sum(axis=1)
    if batch == 64:
        assert len(set(expected_votes.tolist())) > 1  # the thresholds split the batch
    for min_votes in (1, 3, 5):
        logits, votes, decision = five_head_vote_reference(*args, min_votes=min_votes)
        assert logits.shape == (batch, NUM_HEADS) and logits.dtype == torch.float32
        assert votes.shape == (batch,) and votes.dtype == torch.int32
        assert decision.shape == (batch,) and decision.dtype == torch.bool
        np.testing.assert_allclose(logits.numpy(), expected, atol=1e-4, rtol=1e-4)
        np.testing.assert_array_equal(votes.numpy()[clear], expected_votes[clear])
        np.testing.assert_array_equal(decision.numpy(), votes.numpy() >= min_votes)
        np.testing.assert_array_equal(decision.numpy()[clear], expected_votes[clear] >= min_votes)


def test_five_head_vote_dispatch_matches_reference_on_cpu():
    x, heads, thresholds, _ = _random_problem(5, 64, seed=7)
    args = [torch.from_numpy(a) for a in (x, heads.w1, heads.b1, heads.w2, heads.b2, thresholds)]
    for got, want in zip(five_head_vote(*args, min_votes=2), five_head_vote_reference(*args, min_votes=2)):
        assert torch.equal(got, want)


def test_five_head_vote_extreme_thresholds():
    x, heads, _, _ = _random_problem(4, 64, seed=11)
    args = [torch.from_numpy(a) for a in (x, heads.w1, heads.b1, heads.w2, heads.b2)]
    low = torch.full((NUM_HEADS,), -1e6)
    high = torch.full((NUM_HEADS,), 1e6)
    _, votes, decision = five_head_vote_reference(*args, low, min_votes=5)
    assert votes.tolist() == [5] * 4 and decision.all()
    _, votes, decision = five_head_vote_reference(*args, high, min_votes=1)
    assert votes.tolist() == [0] * 4 and not decision.any()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("x_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 7, 64, 128, 1024])
def test_cuda_dispatch_uses_triton_and_matches(batch, x_dtype, monkeypatch):
    # not `import kernels.five_head_vote as module`: the package re-exports the function
    # under the module's name, and that import form returns the attribute
    module = importlib.import_module("vllm_pamer.kernels.five_head_vote")

    calls = []
    launch = module.five_head_vote_triton
    monkeypatch.setattr(module, "five_head_vote_triton", lambda *a, **k: calls.append(1) or launch(*a, **k))
    args, logits64 = vote_problem(batch, 4096, x_dtype=DTYPES[x_dtype], seed=batch)
    got = five_head_vote(*[t.cuda() for t in args], min_votes=3)
    assert calls and got[0].is_cuda
    check_vote(got, logits64, args[5], 3)
    # bf16 rows and heads: the tensor-core path
    args16, logits16 = vote_problem(batch, 4096, x_dtype=torch.bfloat16, w_dtype=torch.bfloat16, seed=batch)
    check_vote(five_head_vote(*[t.cuda() for t in args16], min_votes=3), logits16, args16[5], 3)


@cuda
@pytest.mark.parametrize("bf16_heads", [False, True])
def test_cuda_graph_replays_equal_direct_launches(bf16_heads):
    """Each bucket captured once and replayed: every batch size from 1 to past
    the largest graph gives what a direct launch gives."""
    args, _ = vote_problem(600, 4096, x_dtype=torch.bfloat16, seed=5)
    cuda_args = [t.cuda() for t in args]
    held = FiveHeadVote(*cuda_args[1:], min_votes=3, device="cuda", bf16_heads=bf16_heads)
    for rows in (1, 2, 3, 7, 16, 9, 100, 512, 600, 1):
        x = cuda_args[0][:rows]
        got = [t.clone() for t in held(x)]
        want = held.direct(x)
        for g, w in zip(got, want):
            assert torch.equal(g, w), rows
    assert held.graphs and len(held._graphs) == 7  # buckets 1, 2, 4, 8, 16, 128, 512; 600 launched directly


def test_triton_kernel_under_interpreter():
    """``interp_five_head_vote.py``: the Triton kernel on CPU tensors against the float64 oracle."""
    run_interpreted(Path(__file__).with_name("interp_five_head_vote.py"))


def test_triton_kernel_compiles_for_nvidia_without_spills():
    """At the tiles the launcher plans (4 shapes) for H200 targets, without a GPU."""
    check_compiles_without_spills("five_head_vote", variants=4)
