"""Fused Triton kernel: session-masked cosine Top-K over a memory matrix, in one
launch.

Why this shape. The cost is reading M once (N * e elements: 2 GB at N = 1e6,
e = 1024 in bf16), so the grid is (B-block, N-slice): enough N-slices to give
every SM rows to stream even for one query, and each program serves a block of
queries, so M is read once per B-block (and B-blocks of the same slice run side
by side, sharing it in L2). Per chunk of BLOCK_N rows a program

* loads the rows' sessions first and skips the chunk when none belongs to its
  queries' sessions (8 bytes a row instead of 2e);
* computes dot products with tl.dot (fp32 accumulation) and the rows' norms in
  the same pass, masks other sessions / free rows / zero norms to -inf;
* merges the chunk into a running top-k kept in registers ([BLOCK_B, KPAD],
  sorted by score desc, row asc) -- only when some score beats the current
  k-th, which after the first chunks is rare.

The N-slices' top-k lists are merged inside the same launch by the last
program of each B-block to arrive (integer atomic counter; the partial lists
are published before it). It merges in slice order, so the result does not
depend on which program came last. Ties: rows are visited in increasing order
within a slice and slices in increasing order at the merge, and the merge
compares (score, row) explicitly, so equal scores come out lowest row first.

Scratch per call: one zeroed int32 counter per B-block (a memset, not a kernel)
and the partial lists (B x slices x KPAD); no host synchronisation.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_pamer.kernels._common import check_topk_inputs
from vllm_pamer.kernels._triton_utils import (
    cdiv,
    check_device,
    default_precision,
    is_interpreted,
    next_pow2,
    target_programs,
)

_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _merge_topk(best_s, best_i, cand_s, cand_i, K: tl.constexpr, KPAD: tl.constexpr):
    """Merge candidates (cand_s, cand_i) [BB, C] into the running list (best_s,
    best_i) [BB, KPAD]; both lists hold distinct rows. K rounds: each takes the
    better head of the two lists by (score desc, row asc). A -inf score is "no
    match" and is written with row -1."""
    cols = tl.arange(0, KPAD)[None, :]
    new_s = tl.full(best_s.shape, float("-inf"), tl.float32)
    new_i = tl.full(best_i.shape, -1, tl.int32)
    for t in range(K):  # a loop, not unrolled: keeps registers down
        cm = tl.max(cand_s, axis=1)
        ci = tl.min(tl.where(cand_s == cm[:, None], cand_i, _INT32_MAX), axis=1)
        rm = tl.max(best_s, axis=1)
        ri = tl.min(tl.where(best_s == rm[:, None], best_i, _INT32_MAX), axis=1)
        take_c = (cm > rm) | ((cm == rm) & (ci < ri) & (cm > float("-inf")))
        m = tl.where(take_c, cm, rm)
        i = tl.where(m > float("-inf"), tl.where(take_c, ci, ri), -1)
        new_s = tl.where(cols == t, m[:, None], new_s)
        new_i = tl.where(cols == t, i[:, None], new_i)
        # drop the taken entry from its list
        cand_s = tl.where(take_c[:, None] & (cand_i == ci[:, None]), float("-inf"), cand_s)
        best_s = tl.where((~take_c)[:, None] & (best_i == ri[:, None]), float("-inf"), best_s)
    return new_s, new_i


@triton.jit
def _kth(best_s, K: tl.constexpr, KPAD: tl.constexpr):
    """Score of the k-th entry of each running list (-inf while not full)."""
    cols = tl.arange(0, KPAD)[None, :]
    return tl.max(tl.where(cols == K - 1, best_s, float("-inf")), axis=1)


@triton.jit
def _cosine_topk_kernel(
    q_ptr,
    qsess_ptr,
    m_ptr,
    rsess_ptr,  # inputs
    idx_ptr,
    score_ptr,  # outputs [B, K]
    part_s_ptr,
    part_i_ptr,
    count_ptr,  # scratch
    B,
    N,
    E,
    rows_per_split,
    n_splits,
    stride_qb,
    stride_qe,
    stride_mn,
    stride_me,
    K: tl.constexpr,
    KPAD: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    qrows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    qmask = qrows < B
    cols = tl.arange(0, KPAD)

    # query norms; an unusable query gets session -1, which no row matches
    qsess = tl.load(qsess_ptr + qrows, mask=qmask, other=-1)
    qn2 = tl.zeros([BLOCK_B], dtype=tl.float32)
    for e0 in range(0, E, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        q = tl.load(
            q_ptr + qrows[:, None] * stride_qb + es[None, :] * stride_qe,
            mask=qmask[:, None] & (es < E)[None, :],
            other=0.0,
        ).to(tl.float32)
        qn2 += tl.sum(q * q, axis=1)
    q_ok = qmask & (qsess >= 0) & (qn2 > 0)
    inv_qn = tl.where(q_ok, 1.0 / tl.sqrt(tl.where(q_ok, qn2, 1.0)), 0.0)
    qsess = tl.where(q_ok, qsess, -1)

    best_s = tl.full([BLOCK_B, KPAD], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_B, KPAD], -1, tl.int32)
    n_lo = pid_s * rows_per_split
    n_hi = tl.minimum(n_lo + rows_per_split, N)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        nmask = rn < n_hi
        rsess = tl.load(rsess_ptr + rn, mask=nmask, other=-1)
        match = (rsess[None, :] == qsess[:, None]) & (rsess >= 0)[None, :]
        if tl.max(match.to(tl.int32)) > 0:  # else: no row of these sessions, skip reading M
            dot = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
            mn2 = tl.zeros([BLOCK_N], dtype=tl.float32)
            m_rows = m_ptr + rn.to(tl.int64)[:, None] * stride_mn  # N * e can pass 2**31
            for e0 in range(0, E, BLOCK_E):
                es = e0 + tl.arange(0, BLOCK_E)
                emask = es < E
                q = tl.load(
                    q_ptr + qrows[:, None] * stride_qb + es[None, :] * stride_qe,
                    mask=qmask[:, None] & emask[None, :],
                    other=0.0,
                )
                m = tl.load(m_rows + es[None, :] * stride_me, mask=nmask[:, None] & emask[None, :], other=0.0)
                mf = m.to(tl.float32)
                mn2 += tl.sum(mf * mf, axis=1)
                if DOT_FP32:
                    dot += tl.dot(q.to(tl.float32), tl.trans(mf), input_precision=PRECISION)
                else:  # both bf16 (or both fp16): exact products, fp32 sums
                    dot += tl.dot(q, tl.trans(m))
            inv_mn = 1.0 / tl.sqrt(tl.where(mn2 > 0, mn2, 1.0))
            s = dot * inv_qn[:, None] * inv_mn[None, :]
            s = tl.where(match & (mn2 > 0)[None, :] & (s == s), s, float("-inf"))
            # rows here are above every row already kept, so a tie with the
            # k-th loses: merge only when something strictly beats it
            beats = tl.max(s, axis=1) > _kth(best_s, K, KPAD)
            if tl.max(beats.to(tl.int32)) > 0:
                cand_i = tl.broadcast_to(rn[None, :], (BLOCK_B, BLOCK_N))
                best_s, best_i = _merge_topk(best_s, best_i, s, cand_i, K, KPAD)

    out_offs = qrows[:, None] * K + cols[None, :]
    out_mask = qmask[:, None] & (cols < K)[None, :]
    if SPLIT:
        # publish this slice's list, then the last slice to arrive merges all
        part = (qrows[:, None] * n_splits + pid_s) * KPAD + cols[None, :]
        tl.store(part_s_ptr + part, best_s, mask=qmask[:, None])
        tl.store(part_i_ptr + part, best_i, mask=qmask[:, None])
        tl.debug_barrier()  # all threads' stores precede the release below
        arrived = tl.atomic_add(count_ptr + pid_b, 1, sem="acq_rel")
        if arrived == n_splits - 1:
            best_s = tl.full([BLOCK_B, KPAD], float("-inf"), tl.float32)
            best_i = tl.full([BLOCK_B, KPAD], -1, tl.int32)
            c = tl.arange(0, SPLIT_BLOCK * KPAD)
            slot = c % KPAD
            for s0 in range(0, n_splits, SPLIT_BLOCK):
                sp = s0 + c // KPAD
                cmask = qmask[:, None] & ((sp < n_splits) & (slot < K))[None, :]
                offs = (qrows[:, None] * n_splits + sp[None, :]) * KPAD + slot[None, :]
                cs = tl.load(part_s_ptr + offs, mask=cmask, other=float("-inf"), cache_modifier=".cg")
                ci = tl.load(part_i_ptr + offs, mask=cmask, other=-1, cache_modifier=".cg")
                # later slices hold higher rows: again only strict improvements
                beats = tl.max(cs, axis=1) > _kth(best_s, K, KPAD)
                if tl.max(beats.to(tl.int32)) > 0:
                    best_s, best_i = _merge_topk(best_s, best_i, cs, ci, K, KPAD)
            tl.store(idx_ptr + out_offs, best_i.to(tl.int64), mask=out_mask)
            tl.store(score_ptr + out_offs, best_s, mask=out_mask)
    else:
        tl.store(idx_ptr + out_offs, best_i.to(tl.int64), mask=out_mask)
        tl.store(score_ptr + out_offs, best_s, mask=out_mask)


@functools.lru_cache(maxsize=1024)  # launches repeat shapes; planning is Python overhead
def plan(
    B: int,
    N: int,
    E: int,
    k: int,
    q_dtype: torch.dtype,
    m_dtype: torch.dtype,
    *,
    interpreted: bool,
    programs: int,
    precision: str,
    block_b: int | None = None,
    block_n: int | None = None,
    block_e: int | None = None,
    num_splits: int | None = None,
) -> dict:
    """Tiles, grid and compile-time constants of one launch; ``programs`` is
    how many programs keep the GPU busy (1 under the interpreter). Shared
    with tests/kernels/compile_check.py, which compiles what this plans."""
    kpad = max(2, next_pow2(k))
    block_b = block_b or min(64, max(16, next_pow2(B)))
    if interpreted:
        # the interpreter pays per operation, not per element: few big tiles
        block_n = block_n or 256
        block_e = block_e or min(1024, max(16, next_pow2(E)))
        num_warps = 4
    else:
        # sized so ptxas needs no spills on sm_80/sm_90 (compile_check.py)
        block_n = block_n or (64 if block_b <= 32 else 32)
        block_e = block_e or 32
        num_warps = 4 if block_b <= 16 else 8
    n_bblocks = cdiv(B, block_b)
    n_chunks = max(1, cdiv(N, block_n))
    if num_splits is None:
        num_splits = max(1, programs // n_bblocks)  # slices of N for every SM, even at B = 1
    num_splits = max(1, min(int(num_splits), n_chunks))
    rows_per_split = cdiv(n_chunks, num_splits) * block_n
    num_splits = max(1, cdiv(N, rows_per_split))  # no empty slice
    # the final merge takes [BLOCK_B, SPLIT_BLOCK * KPAD] candidates at a time:
    # about 2048 of them keeps it in registers
    split_block = max(1, (2048 // block_b) // kpad)
    # bf16 x bf16 on tensor cores; the interpreter's tl.dot multiplies bf16 as
    # raw uint16 bits, so there bf16 goes through fp32 (same products, exact)
    native = q_dtype == m_dtype and q_dtype in (torch.float16, torch.bfloat16)
    dot_fp32 = not native or (interpreted and q_dtype == torch.bfloat16)
    return dict(
        grid=(n_bblocks, num_splits),
        n_bblocks=n_bblocks,
        num_splits=num_splits,
        rows_per_split=rows_per_split,
        kpad=kpad,
        constexprs=dict(
            K=k,
            KPAD=kpad,
            SPLIT=num_splits > 1,
            BLOCK_B=block_b,
            BLOCK_N=block_n,
            BLOCK_E=block_e,
            SPLIT_BLOCK=split_block,
            DOT_FP32=dot_fp32,
            PRECISION=precision,
        ),
        options=dict(num_warps=num_warps, num_stages=3),
    )


def cosine_topk_triton(
    queries: torch.Tensor,
    query_sessions: torch.Tensor,
    matrix: torch.Tensor,
    row_sessions: torch.Tensor,
    k: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    precision: str | None = None,
    block_b: int | None = None,
    block_n: int | None = None,
    block_e: int | None = None,
    num_splits: int | None = None,
    poison_scratch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused kernel. Same contract as ``cosine_topk_reference``.

    ``out`` takes preallocated (indices int64 [B, k], scores fp32 [B, k]).
    ``precision`` is tl.dot's input_precision when an operand is fp32 (see
    ``default_precision``; "tf32" is faster, ~1e-3 relative error).
    The block/split arguments override the heuristics (tests use them to cover
    every path); ``poison_scratch`` fills the partial lists with garbage first.
    """
    check_topk_inputs(queries, query_sessions, matrix, row_sessions, k)
    device = check_device(_cosine_topk_kernel, queries, query_sessions, matrix, row_sessions)
    B, E = queries.shape
    N = matrix.shape[0]
    k = int(k)
    if out is None:
        indices = torch.empty((B, k), dtype=torch.int64, device=device)
        scores = torch.empty((B, k), dtype=torch.float32, device=device)
    else:
        indices, scores = out
        assert indices.shape == (B, k) and indices.dtype == torch.int64 and indices.is_contiguous()
        assert scores.shape == (B, k) and scores.dtype == torch.float32 and scores.is_contiguous()
    if B == 0:
        return indices, scores
    if N == 0:
        indices.fill_(-1)
        scores.fill_(float("-inf"))
        return indices, scores
    if N >= 2**31:
        raise ValueError("row numbers are int32 inside the kernel: N must be < 2**31")

    interpreted = is_interpreted(_cosine_topk_kernel)
    p = plan(
        B,
        N,
        E,
        k,
        queries.dtype,
        matrix.dtype,
        interpreted=interpreted,
        programs=target_programs(device, interpreted, per_sm=4),
        precision=precision or default_precision(device, interpreted),
        block_b=block_b,
        block_n=block_n,
        block_e=block_e,
        num_splits=num_splits,
    )
    splits = p["num_splits"]
    qs, rs = query_sessions.contiguous(), row_sessions.contiguous()
    counters = torch.zeros(p["n_bblocks"], dtype=torch.int32, device=device)
    shape = (B, splits, p["kpad"]) if splits > 1 else (1,)
    part_s = torch.empty(shape, dtype=torch.float32, device=device)
    part_i = torch.empty(shape, dtype=torch.int32, device=device)
    if poison_scratch:
        part_s.fill_(float("nan"))
        part_i.fill_(-7)

    _cosine_topk_kernel[p["grid"]](
        queries,
        qs,
        matrix,
        rs,
        indices,
        scores,
        part_s,
        part_i,
        counters,
        B,
        N,
        E,
        p["rows_per_split"],
        splits,
        queries.stride(0),
        queries.stride(1),
        matrix.stride(0),
        matrix.stride(1),
        **p["constexprs"],
        **p["options"],
    )
    return indices, scores
