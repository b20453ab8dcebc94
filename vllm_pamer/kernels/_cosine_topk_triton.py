"""Triton kernel: session-masked cosine Top-K over a memory matrix, as a
bandwidth pass over M and a small merge.

Why this shape. The cost is reading M once (N * e elements: 2 GB at N = 1e6,
e = 1024 in bf16), so the design is the one ``torch.mm`` + ``torch.topk``
gets right, minus the [B, N] score matrix it writes and reads back:

1. ``_tile_topk_kernel``, grid (N-tile, B-block): each program reads its
   BLOCK_N rows of M once (their sessions first: a tile holding no row of its
   queries' sessions is not read at all, 8 bytes a row instead of 2e), takes
   the dot products with its block of queries (tl.dot, fp32 accumulation) and
   the rows' norms in the same pass, masks other sessions / free rows / zero
   norms / NaN, and writes the tile's own top-k per query. No running state,
   no atomics, no merge in the loop: every program is the same short stream.
2. The merge: ``torch.topk`` over the B x (tiles * k) candidates, a few
   hundred thousand at N = 1e6, a read of a few MiB.

Exact order without a host sync: each candidate is one int64 key, the
score's float bits made monotone in the high word and ``INT32_MAX - row`` in
the low word, so the larger key is the better (score desc, row asc) and one
``topk`` over keys orders ties by lower row at both stages. The score and the
row are read back from the key, so both stages agree bit for bit.

Scratch per call: the candidate keys (B x tiles x k int64), every slot written
by the kernel (no memset).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_pamer.kernels._common import check_topk_inputs
from vllm_pamer.kernels._triton_utils import cdiv, check_device, default_precision, is_interpreted, next_pow2

_INT32_MAX = 2147483647
_LOW_MASK = 0xFFFFFFFF
_ROW_SHIFT = 4294967296  # 2**32: the score's bits sit above the row's


def _monotone(score: float) -> int:
    """The int32 whose signed order is the float32 order of ``score``."""
    bits = int(torch.tensor([score], dtype=torch.float32).view(torch.int32))
    return bits if bits >= 0 else bits ^ _INT32_MAX


NONE_KEY = _monotone(float("-inf")) * _ROW_SHIFT + (_INT32_MAX + 1)
"""The key of "no match": score -inf, row -1 (below every real candidate)."""


@triton.jit
def _tile_topk_kernel(
    q_ptr,
    qsess_ptr,
    m_ptr,
    rsess_ptr,
    key_ptr,  # out: [B, n_tiles, K] int64 candidate keys
    B,
    N,
    E,
    n_tiles,
    stride_qb,
    stride_qe,
    stride_mn,
    stride_me,
    K: tl.constexpr,
    NONE_KEY: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    qrows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    qmask = qrows < B
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N

    qsess = tl.load(qsess_ptr + qrows, mask=qmask, other=-1)
    rsess = tl.load(rsess_ptr + rn, mask=nmask, other=-1)
    match = (rsess[None, :] == qsess[:, None]) & (rsess >= 0)[None, :] & (qsess >= 0)[:, None]
    s = tl.full([BLOCK_B, BLOCK_N], float("-inf"), tl.float32)
    if tl.max(match.to(tl.int32)) > 0:  # else: no row of these sessions, M not read
        dot = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
        qn2 = tl.zeros([BLOCK_B], dtype=tl.float32)
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
            qf = q.to(tl.float32)
            mf = m.to(tl.float32)
            qn2 += tl.sum(qf * qf, axis=1)
            mn2 += tl.sum(mf * mf, axis=1)
            if DOT_FP32:
                dot += tl.dot(qf, tl.trans(mf), input_precision=PRECISION)
            else:  # both bf16 (or both fp16): exact products, fp32 sums
                dot += tl.dot(q, tl.trans(m))
        inv_qn = 1.0 / tl.sqrt(tl.where(qn2 > 0, qn2, 1.0))
        inv_mn = 1.0 / tl.sqrt(tl.where(mn2 > 0, mn2, 1.0))
        # scale after the dot, as the torch reference does (exact dots stay
        # exact); + 0.0 turns -0.0, whose key sorts below +0.0, into +0.0
        s = dot * inv_qn[:, None] * inv_mn[None, :] + 0.0
        ok = match & (qn2 > 0)[:, None] & (mn2 > 0)[None, :] & (s == s)
        s = tl.where(ok, s, float("-inf"))

    # the tile's top-k per query, K rounds of (best score, lowest row of it),
    # each written as its key
    out = key_ptr + (qrows.to(tl.int64) * n_tiles + pid_n) * K
    for t in range(K):
        best = tl.max(s, axis=1)
        row = tl.min(tl.where(s == best[:, None], rn[None, :], 2147483647), axis=1)
        bits = best.to(tl.int32, bitcast=True)
        monotone = tl.where(bits >= 0, bits, bits ^ 2147483647).to(tl.int64)
        key = tl.where(best > float("-inf"), monotone * 4294967296 + (2147483647 - row), NONE_KEY)
        tl.store(out + t, key, mask=qmask)
        s = tl.where(rn[None, :] == row[:, None], float("-inf"), s)


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
    precision: str,
    block_b: int | None = None,
    block_n: int | None = None,
    block_e: int | None = None,
) -> dict:
    """Tiles, grid and compile-time constants of one launch. Shared with
    tests/support/kernels/compile_check.py, which compiles what this plans."""
    block_b = block_b or min(64, max(16, next_pow2(B)))
    # bf16 x bf16 on tensor cores; the interpreter's tl.dot multiplies bf16 as
    # raw uint16 bits, so there bf16 goes through fp32 (same products, exact)
    native = q_dtype == m_dtype and q_dtype in (torch.float16, torch.bfloat16)
    dot_fp32 = not native or (interpreted and q_dtype == torch.bfloat16)
    if interpreted:
        # the interpreter pays per operation, not per element: few big tiles
        block_n = block_n or 256
        block_e = block_e or min(1024, max(16, next_pow2(E)))
    else:
        # many rows per program, so the loads of M pipeline (num_stages);
        # sized so ptxas needs no spills on sm_80/sm_90 (compile_check.py)
        block_n = block_n or (128 if block_b <= 16 else 64)
        block_e = block_e or 32
    num_warps = 4 if native and block_b <= 16 else 8
    n_tiles = max(1, cdiv(N, block_n))
    return dict(
        grid=(n_tiles, cdiv(B, block_b)),
        n_tiles=n_tiles,
        constexprs=dict(
            K=k,
            NONE_KEY=NONE_KEY,
            BLOCK_B=block_b,
            BLOCK_N=block_n,
            BLOCK_E=block_e,
            DOT_FP32=dot_fp32,
            PRECISION=precision,
        ),
        options=dict(num_warps=num_warps, num_stages=3),
    )


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (int64, -1 for no match) and fp32 scores of candidate keys."""
    monotone = torch.div(keys, _ROW_SHIFT, rounding_mode="floor").to(torch.int32)
    bits = torch.where(monotone >= 0, monotone, monotone ^ _INT32_MAX)
    scores = bits.view(torch.float32)
    rows = _INT32_MAX - (keys & _LOW_MASK)
    rows = rows.masked_fill(torch.isneginf(scores), -1)
    return rows, scores


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
    poison_scratch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the tile pass and merge. Same contract as ``cosine_topk_reference``.

    ``out`` takes preallocated (indices int64 [B, k], scores fp32 [B, k]).
    ``precision`` is tl.dot's input_precision when an operand is fp32 (see
    ``default_precision``; "tf32" is faster, ~1e-3 relative error).
    The block arguments override the heuristics (tests use them to cover
    every path); ``poison_scratch`` fills the candidate keys with garbage first.
    """
    check_topk_inputs(queries, query_sessions, matrix, row_sessions, k)
    device = check_device(_tile_topk_kernel, queries, query_sessions, matrix, row_sessions)
    B, E = queries.shape
    N = matrix.shape[0]
    k = int(k)
    if out is not None:
        assert out[0].shape == (B, k) and out[0].dtype == torch.int64 and out[0].is_contiguous()
        assert out[1].shape == (B, k) and out[1].dtype == torch.float32 and out[1].is_contiguous()
    if B == 0 or N == 0:
        indices = torch.full((B, k), -1, dtype=torch.int64, device=device)
        scores = torch.full((B, k), float("-inf"), dtype=torch.float32, device=device)
        return _into(out, indices, scores)
    if N >= _INT32_MAX - 4096:  # rows of the last tile stay below 2**31
        raise ValueError("row numbers are int32 inside the kernel: N must be < 2**31 - 4097")

    interpreted = is_interpreted(_tile_topk_kernel)
    p = plan(
        B,
        N,
        E,
        k,
        queries.dtype,
        matrix.dtype,
        interpreted=interpreted,
        precision=precision or default_precision(device, interpreted),
        block_b=block_b,
        block_n=block_n,
        block_e=block_e,
    )
    keys = torch.empty((B, p["n_tiles"] * k), dtype=torch.int64, device=device)
    if poison_scratch:
        keys.fill_(0x5A5A5A5A5A5A5A5A)
    _tile_topk_kernel[p["grid"]](
        queries,
        query_sessions.contiguous(),
        matrix,
        row_sessions.contiguous(),
        keys,
        B,
        N,
        E,
        p["n_tiles"],
        queries.stride(0),
        queries.stride(1),
        matrix.stride(0),
        matrix.stride(1),
        **p["constexprs"],
        **p["options"],
    )
    indices, scores = decode_keys(keys.topk(k, dim=1).values)  # sorted: best first
    return _into(out, indices, scores)


def _into(
    out: tuple[torch.Tensor, torch.Tensor] | None, indices: torch.Tensor, scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return indices, scores
    out[0].copy_(indices)
    out[1].copy_(scores)
    return out
