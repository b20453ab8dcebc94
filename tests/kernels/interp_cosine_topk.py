"""The cosine Top-K Triton kernel (tile pass + merge) under the Triton interpreter (CPU
tensors) against the float64 oracle. Not collected by a plain ``pytest``
(no test_ prefix): ``test_cosine_topk.py`` runs this module in a fresh
process with TRITON_INTERPRET=1 (``tests/support/kernels/fresh_process.py``
says why). N stays in the thousands here (the interpreter is slow); large N is
tested on the torch path."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # effective only if the kernel module isn't imported yet

import numpy as np
import pytest
import torch

from tests.support.kernels.oracles import (
    check_topk,
    poisoned_topk_outputs,
    tie_problem,
    topk_exact_oracle,
    topk_problem,
)
from vllm_pamer.kernels import cosine_topk_reference, cosine_topk_triton
from vllm_pamer.kernels._cosine_topk_triton import _tile_topk_kernel
from vllm_pamer.kernels._triton_utils import is_interpreted

if not is_interpreted(_tile_topk_kernel):
    pytest.skip("needs TRITON_INTERPRET=1 before the kernel module is imported", allow_module_level=True)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _run(problem, k, **kwargs):
    queries = problem[0]
    out = poisoned_topk_outputs(queries.shape[0], k)
    got = cosine_topk_triton(*problem, k, out=out, poison_scratch=True, **kwargs)
    assert got[0] is out[0] and got[1] is out[1]  # wrote into the given buffers
    return got, check_topk(got, *problem, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e", [384, 1024])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_topk_matches_float64(batch, e, dtype):
    problem = topk_problem(batch, 1000, e, DTYPES[dtype], seed=batch * 31 + e)
    (indices, _), exact = _run(problem, 8)
    assert exact >= batch  # the exact-row comparisons did apply
    if batch >= 7:  # session 0, zero query, session -1, zero-only session: nothing
        no_match = (problem[1] == 0) | (problem[1] == -1) | (problem[1] == 6) | (problem[0].float().norm(dim=1) == 0)
        assert (indices[no_match] == -1).all()
        # sessions of 1, 2 and 3 rows: that many, then -1
        for session, count in ((1, 1), (2, 2), (3, 3)):
            rows = indices[problem[1] == session]
            assert ((rows >= 0).sum(dim=1) == count).all()


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_topk_every_k(k):
    _run(topk_problem(7, 1000, 384, seed=k), k, block_n=64)


@pytest.mark.parametrize(
    "batch,n,e,config",
    [
        (7, 3000, 384, dict(block_n=64)),  # 47 tiles
        (64, 2000, 1024, dict(block_b=32)),  # 2 B-blocks
        (20, 777, 384, dict(block_n=32, block_e=128)),  # ragged B, N and e blocks
        (1, 2100, 384, dict(block_n=16)),  # 132 tiles for one query
    ],
)
def test_topk_tile_paths(batch, n, e, config):
    """Many tiles' candidates merged into one list per query."""
    _run(topk_problem(batch, n, e, torch.bfloat16, seed=n), 8, **config)


@pytest.mark.parametrize(
    "config",
    [
        dict(),  # two tiles
        dict(block_n=32),  # ten tiles: ties between tiles
        dict(block_n=16),  # nineteen
        dict(block_b=16),  # two B-blocks
    ],
)
def test_topk_ties_by_lower_row(config):
    """Exact duplicates everywhere: equal scores must come lowest row first,
    within a tile and across tiles, exactly as the oracle orders them."""
    problem = tie_problem(batch=20, n=300)
    want = topk_exact_oracle(*problem, 8)
    indices, scores = cosine_topk_triton(*problem, 8, **config)
    np.testing.assert_array_equal(indices.numpy(), want)
    assert (scores[:, :-1] == scores[:, 1:]).any()  # there were ties to break
    torch.testing.assert_close(cosine_topk_reference(*problem, 8)[0], indices, rtol=0, atol=0)


def test_topk_clustered_sessions_skip_chunks():
    """Each session's rows contiguous: most tiles hold none of a query's
    session and are skipped without reading M."""
    queries, query_sessions, matrix, _ = topk_problem(7, 2000, 384, seed=9)
    row_sessions = torch.arange(2000, dtype=torch.int64) // 400  # sessions 0..4, 400 rows each
    row_sessions[1000:1010] = -1
    query_sessions = torch.tensor([0, 2, 4, 4, 1, 5, 3])
    _run((queries, query_sessions, matrix, row_sessions), 8, block_n=64)
    _run((queries, query_sessions, matrix, row_sessions), 8, block_n=16)


def test_topk_mixed_dtypes_and_strided_queries():
    """fp32 queries against a bf16 matrix (how MemoryMatrix may store it)."""
    queries, query_sessions, matrix, row_sessions = topk_problem(7, 1000, 384, seed=4)
    wide = torch.randn(7, 768)
    wide[:, ::2] = queries
    problem = (wide[:, ::2], query_sessions, matrix.bfloat16(), row_sessions)
    _run(problem, 5, block_n=128)


def test_topk_nothing_to_match():
    queries, query_sessions, matrix, row_sessions = topk_problem(7, 400, 384, seed=2)
    free = torch.full_like(row_sessions, -1)
    indices, scores = cosine_topk_triton(queries, query_sessions, matrix, free, 4, block_n=128)
    assert (indices == -1).all() and torch.isneginf(scores).all()
    indices, scores = cosine_topk_triton(queries, query_sessions, matrix[:0], row_sessions[:0], 4)
    assert (indices == -1).all() and torch.isneginf(scores).all()
    indices, scores = cosine_topk_triton(queries[:0], query_sessions[:0], matrix, row_sessions, 4)
    assert indices.shape == (0, 4) and scores.shape == (0, 4)


def test_topk_deterministic():
    problem = topk_problem(7, 1000, 384, torch.bfloat16, seed=1)
    first = cosine_topk_triton(*problem, 8, block_n=64)
    second = cosine_topk_triton(*problem, 8, block_n=64)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
