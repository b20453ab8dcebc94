"""The fused five-head vote Triton kernel under the Triton interpreter (CPU
tensors) against the float64 oracle. Not collected by a plain ``pytest``
(no test_ prefix): ``test_five_head_vote.py`` runs this module in a fresh
process with TRITON_INTERPRET=1 (``tests/support/kernels/fresh_process.py``
says why)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # effective only if the kernel module isn't imported yet

import numpy as np
import pytest
import torch

from tests.support.kernels.oracles import check_vote, poisoned_vote_outputs, vote_problem
from vllm_pamer.kernels import five_head_vote_triton
from vllm_pamer.kernels._five_head_vote_triton import _five_head_vote_kernel
from vllm_pamer.kernels._triton_utils import is_interpreted

if not is_interpreted(_five_head_vote_kernel):
    pytest.skip("needs TRITON_INTERPRET=1 before the kernel module is imported", allow_module_level=True)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _run(args, logits64, min_votes=3, **kwargs):
    want_decision = (logits64 > args[5].double().numpy()).sum(axis=1) >= min_votes
    out = poisoned_vote_outputs(args[0].shape[0], want_decision)
    got = five_head_vote_triton(*args, min_votes, out=out, poison_scratch=True, **kwargs)
    assert all(g is o for g, o in zip(got, out))  # wrote into the given buffers
    return check_vote(got, logits64, args[5], min_votes)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("d", [576, 4096])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_vote_matches_float64(batch, d, x_dtype):
    """Rows in the model's dtype, heads in fp32 (how the worker holds them)."""
    args, logits64 = vote_problem(batch, d, x_dtype=DTYPES[x_dtype], seed=batch * 7919 + d)
    clear = _run(args, logits64)
    assert clear >= max(1, batch // 2)
    if batch == 64:
        votes = five_head_vote_triton(*args, 3)[1]
        assert len(set(votes.tolist())) > 1  # the thresholds split the batch


@pytest.mark.parametrize("w_dtype", ["bf16", "fp16"])
def test_vote_sixteen_bit_heads(w_dtype):
    """Rows and heads in the same 16-bit type: the native tl.dot path (bf16 runs
    through fp32 under the interpreter, whose dot mishandles bf16)."""
    dtype = DTYPES[w_dtype]
    args, logits64 = vote_problem(7, 576, x_dtype=dtype, w_dtype=dtype, seed=5)
    _run(args, logits64)


@pytest.mark.parametrize(
    "batch,d,config",
    [
        (7, 576, dict(num_splits=3, block_w=64, block_d=64)),  # 3 d-slices, 4 W-blocks a head
        (64, 4096, dict(num_splits=4, block_w=128, block_b=32)),  # 2 B-blocks, 4 d-slices
        (20, 600, dict(num_splits=5, block_w=32, block_d=64, block_b=16)),  # ragged B and last d-chunk
        (1, 8192, dict(num_splits=8, block_d=256)),  # the largest d
    ],
)
def test_vote_split_paths(batch, d, config):
    """The in-launch reductions: partial sums over d-slices and W-blocks
    finished by the last program to arrive."""
    args, logits64 = vote_problem(batch, d, seed=batch + d)
    _run(args, logits64, **config)


@pytest.mark.parametrize("min_votes", [1, 5])
def test_vote_min_votes(min_votes):
    args, logits64 = vote_problem(16, 576, seed=min_votes)
    _run(args, logits64, min_votes=min_votes)


def test_vote_non_contiguous_rows():
    args, logits64 = vote_problem(7, 576, seed=3)
    wide = torch.randn(7, 2 * 576)
    wide[:, ::2] = args[0]
    args[0] = wide[:, ::2]
    assert not args[0].is_contiguous()
    _run(args, logits64)


def test_vote_extreme_thresholds():
    args, _ = vote_problem(4, 576, seed=11)
    args[5] = torch.full((5,), -1e6)
    _, votes, decision = five_head_vote_triton(*args, 5)
    assert votes.tolist() == [5] * 4 and decision.all()
    args[5] = torch.full((5,), 1e6)
    _, votes, decision = five_head_vote_triton(*args, 1)
    assert votes.tolist() == [0] * 4 and not decision.any()


def test_vote_deterministic_and_empty_batch():
    args, _ = vote_problem(7, 576, seed=13)
    first = five_head_vote_triton(*args, 3, num_splits=3, block_w=64)
    second = five_head_vote_triton(*args, 3, num_splits=3, block_w=64)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    args[0] = args[0][:0]
    logits, votes, decision = five_head_vote_triton(*args, 3)
    assert logits.shape == (0, 5) and votes.shape == (0,) and decision.shape == (0,)
    np.testing.assert_array_equal(votes.numpy(), [])


def test_vote_scratch_is_kept_and_left_zeroed():
    """A second call of a shape reuses its scratch: the kernel zeroed the
    counters it used (else that call would finish early with partial sums)."""
    from vllm_pamer.kernels._five_head_vote_triton import _SCRATCH

    args, logits64 = vote_problem(7, 576, seed=11)
    for _ in range(3):
        _run(args, logits64, num_splits=3, block_w=64, block_d=64)
    used = [counters for counters, _, _ in _SCRATCH.values()]
    assert used and all(int(c.abs().sum()) == 0 for c in used)
    before = len(_SCRATCH)
    _run(args, logits64, num_splits=3, block_w=64, block_d=64)
    assert len(_SCRATCH) == before
