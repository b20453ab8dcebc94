"""Fused Triton kernel: five MLP heads (d -> W -> 1, exact-erf GELU) and the
k-of-H vote, in one launch.

Why this shape. At the batch sizes the worker sees (B <= 128) the cost is
reading W1 (H * d * W elements, 21 MB at d = 4096 in fp32); the FLOPs are few.
So the grid spreads W1 over the whole GPU: each program owns one tile of
(B-block, head, W-block of hidden units, slice of d) and reads its weight
slice exactly once for its B-block. The nonlinearity and the vote need full
sums, which other programs finish, so the reductions happen inside the same
launch with the "last program to arrive finishes" pattern (integer atomic
counters; no float atomics, so results are deterministic):

1. every program computes a partial pre-activation h[b, units] over its slice
   of d (fp32 accumulation, tl.dot);
2. with several d-slices (only when a small batch would leave SMs idle) each
   program stores its partial; the last of the slices of a (B-block, head,
   W-block) sums them in slice order, adds b1, applies GELU and dots with w2,
   giving that W-block's contribution to the head's logit;
3. the last W-block program of a B-block sums the contributions in fixed
   order, adds b2, and writes logits, votes and the decision.

Scratch persists between calls (``_scratch``): the counters are zeroed once,
when first allocated, and the last program to use each counter sets it back
to zero; partial buffers need no initialisation: every slot is written before
the counter that publishes it is bumped. So a call allocates nothing and
launches one kernel (no memset), and no host synchronisation.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_pamer.kernels._triton_utils import (
    cdiv,
    check_device,
    default_precision,
    is_interpreted,
    next_pow2,
    target_programs,
)

_SQRT1_2 = tl.constexpr(0.7071067811865476)


@triton.jit
def _five_head_vote_kernel(
    x_ptr,
    w1_ptr,
    b1_ptr,
    w2_ptr,
    b2_ptr,
    thr_ptr,  # inputs
    logits_ptr,
    votes_ptr,
    decision_ptr,  # outputs
    hpart_ptr,
    lpart_ptr,
    tile_count_ptr,
    block_count_ptr,  # scratch
    B,
    D,
    W,
    min_votes,
    chunks_per_split,
    n_wb,
    stride_xb,
    stride_xd,
    stride_wh,
    stride_wd,
    stride_ww,
    stride_b1h,
    stride_w2h,
    H: tl.constexpr,
    HPAD: tl.constexpr,
    N_SPLITS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # B-block is the fastest grid axis: programs sharing a weight tile run
    # side by side, so at larger B the second B-block finds the tile in L2.
    pid_b = tl.program_id(0)
    pid_t = tl.program_id(1)
    wtile = pid_t // N_SPLITS  # (head, W-block), head-major
    split = pid_t % N_SPLITS  # slice of d
    head = wtile // n_wb
    wb = wtile % n_wb
    n_wtiles = H * n_wb

    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    units = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    umask = units < W

    # 1. partial pre-activation over this program's slice of d
    d_lo = split * chunks_per_split * BLOCK_D
    d_hi = tl.minimum(d_lo + chunks_per_split * BLOCK_D, D)
    acc = tl.zeros([BLOCK_B, BLOCK_W], dtype=tl.float32)
    w_base = w1_ptr + head * stride_wh + units[None, :] * stride_ww
    for d0 in range(d_lo, d_hi, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        dmask = ds < d_hi
        xt = tl.load(
            x_ptr + rows[:, None] * stride_xb + ds[None, :] * stride_xd, mask=rmask[:, None] & dmask[None, :], other=0.0
        )
        wt = tl.load(w_base + ds[:, None] * stride_wd, mask=dmask[:, None] & umask[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32), input_precision=PRECISION)
        else:  # both operands bf16 (or both fp16): products are exact, sums fp32
            acc += tl.dot(xt, wt)

    # 2. sum the d-slices (only when the launcher split d)
    hidden_cols = head * W + units
    if N_SPLITS > 1:
        part_ptrs = hpart_ptr + rows[:, None] * (H * W) + hidden_cols[None, :]
        pmask = rmask[:, None] & umask[None, :]
        tl.store(part_ptrs + split * B * (H * W), acc, mask=pmask)
        tl.debug_barrier()  # all threads' stores precede the release below
        arrived = tl.atomic_add(tile_count_ptr + pid_b * n_wtiles + wtile, 1, sem="acq_rel")
        tile_done = arrived == N_SPLITS - 1
    else:
        tile_done = True

    if tile_done:
        if N_SPLITS > 1:
            # every slice has arrived: zero the counter for the next launch
            tl.atomic_xchg(tile_count_ptr + pid_b * n_wtiles + wtile, 0)
            # fixed slice order, whichever program arrived last: deterministic
            acc = tl.zeros([BLOCK_B, BLOCK_W], dtype=tl.float32)
            for s in range(N_SPLITS):
                acc += tl.load(part_ptrs + s * B * (H * W), mask=pmask, other=0.0, cache_modifier=".cg")
        b1 = tl.load(b1_ptr + head * stride_b1h + units, mask=umask, other=0.0).to(tl.float32)
        w2 = tl.load(w2_ptr + head * stride_w2h + units, mask=umask, other=0.0).to(tl.float32)
        h = acc + b1[None, :]
        g = 0.5 * h * (1.0 + tl.math.erf(h * _SQRT1_2))  # torch's default (erf) GELU
        contrib = tl.sum(g * w2[None, :], axis=1)  # masked units have w2 = 0
        tl.store(lpart_ptr + wtile * B + rows, contrib, mask=rmask)
        tl.debug_barrier()
        arrived_b = tl.atomic_add(block_count_ptr + pid_b, 1, sem="acq_rel")

        # 3. the last tile of this B-block finishes the heads and votes
        if arrived_b == n_wtiles - 1:
            tl.atomic_xchg(block_count_ptr + pid_b, 0)  # every tile has arrived
            hs = tl.arange(0, HPAD)
            hmask = hs < H
            m2 = rmask[:, None] & hmask[None, :]
            logit = tl.zeros([BLOCK_B, HPAD], dtype=tl.float32)
            for j in range(n_wb):
                logit += tl.load(
                    lpart_ptr + (hs[None, :] * n_wb + j) * B + rows[:, None], mask=m2, other=0.0, cache_modifier=".cg"
                )
            logit += tl.load(b2_ptr + hs, mask=hmask, other=0.0).to(tl.float32)[None, :]
            thr = tl.load(thr_ptr + hs, mask=hmask, other=0.0).to(tl.float32)
            tl.store(logits_ptr + rows[:, None] * H + hs[None, :], logit, mask=m2)
            fired = (logit > thr[None, :]) & hmask[None, :]
            votes = tl.sum(fired.to(tl.int32), axis=1)
            tl.store(votes_ptr + rows, votes, mask=rmask)
            tl.store(decision_ptr + rows, votes >= min_votes, mask=rmask)


@functools.lru_cache(maxsize=1024)  # launches repeat shapes; planning is Python overhead
def plan(
    B: int,
    D: int,
    H: int,
    W: int,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    *,
    interpreted: bool,
    programs: int,
    precision: str,
    block_b: int | None = None,
    block_w: int | None = None,
    block_d: int | None = None,
    num_splits: int | None = None,
) -> dict:
    """Tiles, grid and compile-time constants of one launch; ``programs`` is
    how many programs keep the GPU busy (1 under the interpreter). Shared
    with tests/support/kernels/compile_check.py, which compiles what this plans."""
    block_b = block_b or min(64, max(16, next_pow2(B)))
    if interpreted:
        # the interpreter pays per operation, not per element: few big tiles
        block_w = block_w or max(16, next_pow2(W))
        block_d = block_d or 512
    else:
        # sized so ptxas needs no spills on sm_80/sm_90 (compile_check.py)
        block_w = block_w or 32
        block_d = block_d or (64 if block_b <= 16 else 32)
    n_wb = cdiv(W, block_w)
    n_bblocks = cdiv(B, block_b)
    n_dchunks = cdiv(D, block_d)
    if num_splits is None:
        # split d only as far as needed to give every SM weight to stream
        num_splits = programs // (H * n_wb * n_bblocks)
    num_splits = max(1, min(int(num_splits), n_dchunks))
    chunks_per_split = cdiv(n_dchunks, num_splits)
    num_splits = cdiv(n_dchunks, chunks_per_split)  # no empty slice
    # bf16 x bf16 on tensor cores; the interpreter's tl.dot multiplies bf16 as
    # raw uint16 bits, so there bf16 goes through fp32 (same products, exact)
    native = x_dtype == w_dtype and x_dtype in (torch.float16, torch.bfloat16)
    dot_fp32 = not native or (interpreted and x_dtype == torch.bfloat16)
    return dict(
        grid=(n_bblocks, H * n_wb * num_splits),
        n_wb=n_wb,
        n_bblocks=n_bblocks,
        chunks_per_split=chunks_per_split,
        constexprs=dict(
            H=H,
            HPAD=max(2, next_pow2(H)),
            N_SPLITS=num_splits,
            BLOCK_B=block_b,
            BLOCK_W=block_w,
            BLOCK_D=block_d,
            DOT_FP32=dot_fp32,
            PRECISION=precision,
        ),
        options=dict(num_warps=4, num_stages=3),
    )


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _scratch(
    device: torch.device, n_counters: int, n_wtiles: int, B: int, splits: int, hidden: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch's counters (zero: the kernel leaves them so) and partial
    buffers, one set per device, stream and shape, kept for the life of the
    process: launches on one stream run in order, so they share them safely,
    and a CUDA graph that captured a launch (``FiveHeadVote``) may keep
    writing them. A process votes at few shapes (the worker: one per batch
    bucket), so few sets are ever made."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, n_counters, n_wtiles, B, splits, hidden)
    found = _SCRATCH.get(key)
    if found is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # zeros made inside a capture are zeroed only when the graph runs
            raise RuntimeError("five_head_vote: call once on the capturing stream before capturing it in a graph")
        found = _SCRATCH[key] = (
            torch.zeros(n_counters, dtype=torch.int32, device=device),
            torch.empty((n_wtiles, B), dtype=torch.float32, device=device),
            torch.empty((splits, B, hidden) if splits > 1 else (1,), dtype=torch.float32, device=device),
        )
    return found


def five_head_vote_triton(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    thresholds: torch.Tensor,
    min_votes: int = 3,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    precision: str | None = None,
    block_b: int | None = None,
    block_w: int | None = None,
    block_d: int | None = None,
    num_splits: int | None = None,
    poison_scratch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the fused kernel. Same contract as ``five_head_vote_reference``.

    ``out`` takes preallocated (logits fp32 [B, H], votes int32 [B], decision
    bool [B]). ``precision`` is tl.dot's input_precision when an operand is
    fp32 (see ``default_precision``; "tf32" is faster, ~1e-3 relative error).
    The block/split arguments override the heuristics (tests use them to cover
    every path); ``poison_scratch`` fills the partial buffers with NaN first.
    """
    device = check_device(_five_head_vote_kernel, x, w1, b1, w2, b2, thresholds)
    if x.dim() != 2 or w1.dim() != 3 or x.shape[1] != w1.shape[1]:
        raise ValueError(f"x [B, d] and w1 [H, d, W] expected, got {tuple(x.shape)} and {tuple(w1.shape)}")
    H, D, W = w1.shape
    B = x.shape[0]
    if b1.shape != (H, W) or w2.shape != (H, W) or b2.shape != (H,) or thresholds.shape != (H,):
        raise ValueError("b1/w2 must be [H, W] and b2/thresholds [H]")
    if out is None:
        logits = torch.empty((B, H), dtype=torch.float32, device=device)
        votes = torch.empty((B,), dtype=torch.int32, device=device)
        decision = torch.empty((B,), dtype=torch.bool, device=device)
    else:
        logits, votes, decision = out
        assert logits.shape == (B, H) and logits.dtype == torch.float32 and logits.is_contiguous()
        assert votes.shape == (B,) and votes.dtype == torch.int32 and votes.is_contiguous()
        assert decision.shape == (B,) and decision.dtype == torch.bool and decision.is_contiguous()
    if B == 0:
        return logits, votes, decision

    interpreted = is_interpreted(_five_head_vote_kernel)
    p = plan(
        B,
        D,
        H,
        W,
        x.dtype,
        w1.dtype,
        interpreted=interpreted,
        programs=target_programs(device, interpreted, per_sm=3),
        precision=precision or default_precision(device, interpreted),
        block_b=block_b,
        block_w=block_w,
        block_d=block_d,
        num_splits=num_splits,
    )
    splits, n_bblocks, n_wtiles = p["constexprs"]["N_SPLITS"], p["n_bblocks"], H * p["n_wb"]
    b1c, w2c = b1.contiguous(), w2.contiguous()
    b2c, thrc = b2.contiguous(), thresholds.contiguous()
    # per-tile counters, then per-B-block counters; then the partials
    counters, lpart, hpart = _scratch(device, n_bblocks * n_wtiles + n_bblocks, n_wtiles, B, splits, H * W)
    if poison_scratch:
        lpart.fill_(float("nan"))
        hpart.fill_(float("nan"))

    _five_head_vote_kernel[p["grid"]](
        x,
        w1,
        b1c,
        w2c,
        b2c,
        thrc,
        logits,
        votes,
        decision,
        hpart,
        lpart,
        counters,
        counters[n_bblocks * n_wtiles :],
        B,
        D,
        W,
        int(min_votes),
        p["chunks_per_split"],
        p["n_wb"],
        x.stride(0),
        x.stride(1),
        w1.stride(0),
        w1.stride(1),
        w1.stride(2),
        b1c.stride(0),
        w2c.stride(0),
        **p["constexprs"],
        **p["options"],
    )
    return logits, votes, decision
