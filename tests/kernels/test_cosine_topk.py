"""cosine_topk on the torch path (the CPU path and the oracle of the Triton
kernel) against the float64 numpy oracle, including N = 1,000,000, input
checks, dispatch, and (with a GPU) the Triton kernel on CUDA. In fresh
processes (``tests/support/kernels/fresh_process.py``): the Triton kernel on
CPU under the Triton interpreter (``interp_cosine_topk.py``), and compiled for
NVIDIA GPUs."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.kernels.fresh_process import check_compiles_without_spills, run_interpreted
from tests.support.kernels.oracles import check_topk, tie_problem, topk_exact_oracle, topk_problem
from vllm_pamer.kernels import cosine_topk, cosine_topk_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("chunk_rows", [16384, 97])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e", [384, 1024])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_reference_matches_float64(batch, e, dtype, chunk_rows):
    problem = topk_problem(batch, 1000, e, DTYPES[dtype], seed=batch * 31 + e)
    got = cosine_topk_reference(*problem, 8, chunk_rows=chunk_rows)
    assert got[1].dtype == torch.float32
    assert check_topk(got, *problem, 8) >= batch


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_reference_every_k(k):
    problem = topk_problem(7, 1000, 384, seed=k)
    check_topk(cosine_topk_reference(*problem, k, chunk_rows=64), *problem, k)


@pytest.mark.parametrize("chunk_rows", [16384, 7, 64])
def test_reference_ties_by_lower_row(chunk_rows):
    problem = tie_problem(batch=20, n=300)
    indices, scores = cosine_topk_reference(*problem, 8, chunk_rows=chunk_rows)
    np.testing.assert_array_equal(indices.numpy(), topk_exact_oracle(*problem, 8))
    assert (scores[:, :-1] == scores[:, 1:]).any()


def test_reference_one_million_rows():
    """N = 1e6 (small e to keep it cheap): sessions with 0, 1, 2, 3, a few
    hundred and ~half a million rows, scattered over the whole matrix."""
    g = torch.Generator().manual_seed(0)
    n, e = 1_000_000, 16
    row_sessions = torch.randint(10, 1000, (n,), generator=g)
    row_sessions[torch.randperm(n, generator=g)[: n // 2]] = 5  # the big session
    row_sessions[torch.randperm(n, generator=g)[: n // 10]] = -1  # free rows
    spots = torch.randperm(n, generator=g)[:306]
    row_sessions[spots[0]] = 1
    row_sessions[spots[1:3]] = 2
    row_sessions[spots[3:6]] = 3
    row_sessions[spots[6:306]] = 4
    matrix = torch.randn(n, e, generator=g)
    queries = torch.randn(8, e, generator=g)
    query_sessions = torch.tensor([0, 1, 2, 3, 4, 5, 5, 999])
    got = cosine_topk_reference(queries, query_sessions, matrix, row_sessions, 8)
    indices = got[0]
    assert (indices[0] == -1).all()
    assert [(indices[i] >= 0).sum().item() for i in (1, 2, 3)] == [1, 2, 3]
    check_topk(got, queries, query_sessions, matrix, row_sessions, 8)


def test_reference_float64_is_an_oracle():
    problem = topk_problem(7, 500, 384, seed=3)
    problem64 = (problem[0].double(), problem[1], problem[2].double(), problem[3])
    indices, scores = cosine_topk_reference(*problem64, 8)
    assert scores.dtype == torch.float64
    check_topk((indices, scores), *problem64, 8, tol=1e-12)


def test_dispatch_on_cpu_is_the_reference():
    problem = topk_problem(7, 500, 384, torch.bfloat16, seed=4)
    for got, want in zip(cosine_topk(*problem, 5), cosine_topk_reference(*problem, 5)):
        assert torch.equal(got, want)


def test_empty_inputs():
    queries, query_sessions, matrix, row_sessions = topk_problem(3, 100, 64, seed=5)
    indices, scores = cosine_topk(queries, query_sessions, matrix[:0], row_sessions[:0], 4)
    assert (indices == -1).all() and torch.isneginf(scores).all() and indices.shape == (3, 4)
    indices, scores = cosine_topk(queries[:0], query_sessions[:0], matrix, row_sessions, 4)
    assert indices.shape == (0, 4) and scores.shape == (0, 4)


def test_input_checks():
    queries, query_sessions, matrix, row_sessions = topk_problem(3, 100, 64, seed=6)
    with pytest.raises(ValueError):
        cosine_topk(queries, query_sessions, matrix, row_sessions, 0)
    with pytest.raises(ValueError):
        cosine_topk(queries, query_sessions, matrix, row_sessions, 9)
    with pytest.raises(TypeError):
        cosine_topk(queries, query_sessions.int(), matrix, row_sessions, 3)
    with pytest.raises(ValueError):
        cosine_topk(queries[:, :32], query_sessions, matrix, row_sessions, 3)
    with pytest.raises(ValueError):
        cosine_topk(queries, query_sessions[:2], matrix, row_sessions, 3)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("from_rows", [None, 10_000, 30_000])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 7, 64, 512])
def test_cuda_dispatch_by_measured_size_and_both_paths_match(batch, dtype, from_rows, monkeypatch):
    """Triton from ``TRITON_FROM_ROWS`` rows up, torch below it or when unset;
    either way the contract's answer."""
    # not `import kernels.cosine_topk as module`: the package re-exports the function
    # under the module's name, and that import form returns the attribute
    module = importlib.import_module("vllm_pamer.kernels.cosine_topk")

    calls = []
    launch = module.cosine_topk_triton
    monkeypatch.setattr(module, "cosine_topk_triton", lambda *a, **k: calls.append(1) or launch(*a, **k))
    monkeypatch.setattr(module, "TRITON_FROM_ROWS", from_rows)
    problem = topk_problem(batch, 20000, 1024, DTYPES[dtype], seed=batch)
    got = cosine_topk(*(t.cuda() for t in problem), 8)
    assert bool(calls) == (from_rows is not None and from_rows <= 20000) and got[0].is_cuda
    check_topk(got, *problem, 8)
    ties = tie_problem(batch=20, n=3000)
    indices, _ = module.cosine_topk_triton(*(t.cuda() for t in ties), 8)
    np.testing.assert_array_equal(indices.cpu().numpy(), topk_exact_oracle(*ties, 8))


def test_triton_kernel_under_interpreter():
    """``interp_cosine_topk.py``: the Triton kernel on CPU tensors against the float64 oracle."""
    run_interpreted(Path(__file__).with_name("interp_cosine_topk.py"))


def test_triton_kernel_compiles_for_nvidia_without_spills():
    """At the tiles the launcher plans (5 shapes) for H200 and A100 targets, without a GPU."""
    check_compiles_without_spills("cosine_topk", variants=5)
