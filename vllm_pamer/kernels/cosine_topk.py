"""Cosine Top-K over a memory matrix, each query seeing only its own session.

``cosine_topk(queries, query_sessions, matrix, row_sessions, k)`` is the
function callers use. It runs the torch path below (also the tests' oracle)
unless the Triton kernel (``_cosine_topk_triton``) was measured faster for
the call's size on a GPU: ``TRITON_FROM_ROWS``.

Contract (both paths):

* queries [B, e]; query_sessions [B] int64; matrix [N, e]; row_sessions [N]
  int64 with -1 marking a free row; 1 <= k <= 8.
* Score = cosine similarity, computed with fp32 accumulation (the norms are
  computed too, so rows need not be normalised). Rows of another session, free
  rows, zero-norm rows and zero-norm queries (or queries with a negative
  session) never match; nor does a NaN score.
* Returns indices [B, k] int64 (row numbers of ``matrix``, best first, -1 where
  the session has fewer than k matching rows) and scores [B, k] float32 (-inf
  where the index is -1). Equal scores are ordered by lower row number.
"""

from __future__ import annotations

import torch

from vllm_pamer.kernels._common import check_topk_inputs, triton_available


def _exact_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row of ``scores`` [B, C], ordered by (score desc, column
    asc); -inf entries are "no match" and their order does not matter.
    torch.topk does not order ties, so: take the top k + 1; unless the k-th and
    (k+1)-th are equal and finite, those k are the set, and a stable sort of
    them in column order orders their ties. Otherwise (rare) keep every column
    above the k-th value plus the first columns equal to it (cumsum)."""
    B, C = scores.shape
    k = min(k, C)
    if k < C:
        top = scores.topk(k + 1, dim=1)
        kth, next_ = top.values[:, k - 1], top.values[:, k]
        if not bool(((kth == next_) & (kth > float("-inf"))).any()):
            cols = top.indices[:, :k].sort(dim=1).values
            return _order(scores, cols)
        t = kth[:, None]
    else:
        t = scores.min(dim=1, keepdim=True).values
    above = scores > t
    tied = scores == t
    need = k - above.sum(dim=1, keepdim=True)
    take = above | (tied & (tied.cumsum(dim=1) <= need))
    return _order(scores, take.nonzero()[:, 1].view(B, k))  # ascending column per row


def _order(scores: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the picked columns (ascending in each row) by score desc, stably."""
    picked = scores.gather(1, cols)
    order = picked.sort(dim=1, descending=True, stable=True).indices
    return picked.gather(1, order), cols.gather(1, order)


def cosine_topk_reference(
    queries: torch.Tensor,
    query_sessions: torch.Tensor,
    matrix: torch.Tensor,
    row_sessions: torch.Tensor,
    k: int,
    *,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch path (see module docstring). Scans ``matrix`` in chunks of rows
    (default: ~256 MiB of fp32 rows or scores, whichever is bigger) so memory
    stays bounded at any N, keeping a running top-k; on CPU, chunks holding no
    row of the queries' sessions are skipped. Computes in fp32, or float64
    (scores float64) when queries or matrix are float64 (the tests' oracle)."""
    check_topk_inputs(queries, query_sessions, matrix, row_sessions, k)
    B, N = queries.shape[0], matrix.shape[0]
    E = queries.shape[1]
    dtype = torch.float64 if torch.float64 in (queries.dtype, matrix.dtype) else torch.float32
    device = queries.device
    # few big chunks: each op is a parallel region, and on a busy CPU every
    # region waits for its slowest thread
    chunk_rows = chunk_rows or max(1024, 2**26 // max(E, B, 1))
    q = queries.to(dtype)
    qn2 = (q * q).sum(dim=1)
    q_ok = (qn2 > 0) & (query_sessions >= 0)
    inv_qn = torch.where(q_ok, qn2.rsqrt(), 0.0)
    q_sessions = torch.where(q_ok, query_sessions, -1)
    wanted = query_sessions[q_ok] if device.type == "cpu" else None

    best_s = torch.empty((B, 0), dtype=dtype, device=device)
    best_i = torch.empty((B, 0), dtype=torch.int64, device=device)
    for c0 in range(0, N, chunk_rows):
        c1 = min(N, c0 + chunk_rows)
        rs = row_sessions[c0:c1]
        if wanted is not None and not bool(torch.isin(rs, wanted).any()):
            continue  # no row of these sessions here (a cheap check on CPU)
        m = matrix[c0:c1].to(dtype)
        mn = torch.linalg.vector_norm(m, dim=1)  # one pass, no temporary
        # free rows (-1) and zero rows get session -2, which no query has
        rs = torch.where((rs >= 0) & (mn > 0), rs, -2)
        # scale after the dot, as the kernel does (exact dots stay exact)
        s = (q @ m.T) * inv_qn[:, None] * torch.where(mn > 0, 1.0 / mn, 0.0)[None, :]
        s = s.masked_fill((rs[None, :] != q_sessions[:, None]) | s.isnan(), float("-inf"))
        cs, ci = _exact_topk(s, k)
        # running entries have lower row numbers than this chunk's: a stable
        # sort of [running, chunk] keeps ties in row order
        all_s = torch.cat([best_s, cs], dim=1)
        all_i = torch.cat([best_i, ci + c0], dim=1)
        order = all_s.sort(dim=1, descending=True, stable=True).indices[:, :k]
        best_s, best_i = all_s.gather(1, order), all_i.gather(1, order)

    pad = k - best_s.shape[1]
    if pad:
        best_s = torch.cat([best_s, best_s.new_full((B, pad), float("-inf"))], dim=1)
        best_i = torch.cat([best_i, best_i.new_full((B, pad), -1)], dim=1)
    best_i = best_i.masked_fill(best_s == float("-inf"), -1)
    return best_i, best_s if dtype == torch.float64 else best_s.float()


TRITON_FROM_ROWS: int | None = None
"""Rows of the matrix from which the Triton kernel beats the torch path on a
GPU, as ``benchmarks/kernels.py`` measures and prints it; None: it has not
been measured to win, so every call runs torch. The earlier fused design took
0.43-0.54x torch's speed from 1e5 rows up on an H200
(``benchmarks/results/kernels_h200.md``); the tile pass that replaced it has
not run on a GPU yet."""


def cosine_topk_triton(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1). See ``kernels._cosine_topk_triton``."""
    from vllm_pamer.kernels._cosine_topk_triton import cosine_topk_triton as launch

    return launch(*args, **kwargs)


def cosine_topk(
    queries: torch.Tensor,
    query_sessions: torch.Tensor,
    matrix: torch.Tensor,
    row_sessions: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching entry point: the Triton kernel where it was measured faster
    (CUDA, at least ``TRITON_FROM_ROWS`` rows), else torch."""
    if (
        TRITON_FROM_ROWS is not None
        and matrix.shape[0] >= TRITON_FROM_ROWS
        and queries.is_cuda
        and torch.float64 not in (queries.dtype, matrix.dtype)
        and triton_available()
    ):
        return cosine_topk_triton(queries, query_sessions, matrix, row_sessions, k)
    return cosine_topk_reference(queries, query_sessions, matrix, row_sessions, k)
