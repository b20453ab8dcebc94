"""Five MLP heads (d -> 256 -> 1, exact-erf GELU) and the k-of-5 vote.

``FiveHeadVote`` holds the heads on a device for a caller that votes again
and again (the worker's capture): on CUDA it replays each batch size's launch
from a CUDA graph. ``five_head_vote`` is the one-shot function; it
dispatches on the device of ``x``: CUDA tensors run the fused Triton kernel
(``_five_head_vote_triton``, one launch for the five heads and the vote), CPU
tensors run the torch reference below, which is also the oracle for tests. Triton is imported only
when a Triton path is used, so CPU-only installs never import it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from vllm_pamer.kernels._common import triton_available

logger = logging.getLogger("vllm_pamer.kernels")


def five_head_vote_reference(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    thresholds: torch.Tensor,
    min_votes: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, d]; w1 [H, d, W]; b1 [H, W]; w2 [H, W]; b2 [H]; thresholds [H] as
    logits. Returns logits [B, H] fp32, votes [B] int32, decision [B] bool.
    Computes in fp32 (float64 when x or w1 is float64, for oracles; the logits
    are then float64 too)."""
    dtype = torch.float64 if torch.float64 in (x.dtype, w1.dtype) else torch.float32
    hidden = torch.einsum("bd,hdw->bhw", x.to(dtype), w1.to(dtype)) + b1.to(dtype)
    logits = torch.einsum("bhw,hw->bh", F.gelu(hidden), w2.to(dtype)) + b2.to(dtype)
    votes = (logits > thresholds.to(dtype)).sum(dim=-1, dtype=torch.int32)
    return logits, votes, votes >= min_votes


def five_head_vote_triton(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused Triton kernel (CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1). See ``kernels._five_head_vote_triton``."""
    from vllm_pamer.kernels._five_head_vote_triton import five_head_vote_triton as launch

    return launch(*args, **kwargs)


def five_head_vote(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    thresholds: torch.Tensor,
    min_votes: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatching entry point: CUDA -> fused Triton kernel, CPU -> torch."""
    if x.is_cuda and torch.float64 not in (x.dtype, w1.dtype) and triton_available():
        return five_head_vote_triton(x, w1, b1, w2, b2, thresholds, min_votes)
    return five_head_vote_reference(x, w1, b1, w2, b2, thresholds, min_votes)


GRAPH_MAX_ROWS = 512
"""Largest batch replayed from a CUDA graph; larger ones launch directly."""


class FiveHeadVote:
    """The heads held on one device, called on a step's captured rows.

    On CUDA each batch-size bucket (powers of two up to ``GRAPH_MAX_ROWS``) is
    captured once in a CUDA graph and then replayed: per call the caller pays
    one copy of the rows and one graph launch, not Triton's launch planning and
    the kernel's scratch (which the caller would otherwise see as most of the
    cost, ``benchmarks/results/kernels_h200.md``). The returned tensors of a
    replay are views of the graph's buffers: valid until the next call.
    ``bf16_heads``: bf16 rows (a bf16 engine's) are voted on with W1 in bf16,
    which halves the bytes read; the products stay exact and the sums fp32
    (``tests/kernels/test_five_head_vote_bf16.py`` checks the decisions on real states).
    Rows of other dtypes use W1 as given."""

    def __init__(
        self,
        w1: torch.Tensor,
        b1: torch.Tensor,
        w2: torch.Tensor,
        b2: torch.Tensor,
        thresholds: torch.Tensor,
        min_votes: int,
        device: torch.device | str,
        *,
        bf16_heads: bool = False,
        graphs: bool = True,
    ) -> None:
        self.device = torch.device(device)
        # contiguous here: a copy made inside a graph's capture would be freed after it
        self.w1, self.b1, self.w2, self.b2, self.thresholds = (
            t.to(self.device).contiguous() for t in (w1, b1, w2, b2, thresholds)
        )
        self.w1_bf16 = self.w1.bfloat16() if bf16_heads else None
        self.min_votes = int(min_votes)
        self.graphs = graphs and self.device.type == "cuda"
        self._graphs: dict[tuple[int, torch.dtype], tuple[Any, torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self._pool: Any = None

    def direct(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w1 = self.w1_bf16 if self.w1_bf16 is not None and x.dtype == torch.bfloat16 else self.w1
        return five_head_vote(x, w1, self.b1, self.w2, self.b2, self.thresholds, min_votes=self.min_votes)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x.to(self.device)
        rows = x.shape[0]
        if not self.graphs or rows == 0 or rows > GRAPH_MAX_ROWS or not x.is_cuda:
            return self.direct(x)
        bucket = 1 << (rows - 1).bit_length()
        entry = self._graphs.get((bucket, x.dtype))
        if entry is None:
            try:
                entry = self._capture(bucket, x.dtype)
            except Exception:  # a graph cannot be captured here: launch directly from now on
                logger.warning("vllm-pamer: the heads' CUDA graph failed; launching directly", exc_info=True)
                self.graphs = False
                return self.direct(x)
            self._graphs[(bucket, x.dtype)] = entry
        graph, static_x, outputs = entry
        static_x[:rows].copy_(x)
        graph.replay()
        logits, votes, decision = (t[:rows] for t in outputs)
        return logits, votes, decision

    def _capture(self, bucket: int, dtype: torch.dtype) -> tuple[Any, torch.Tensor, tuple[torch.Tensor, ...]]:
        static_x = torch.zeros((bucket, self.w1.shape[1]), dtype=dtype, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        # compiled, and its scratch made and zeroed, before the capture, which
        # runs on the same stream and so finds that scratch (the launcher keys
        # it by stream)
        with torch.cuda.stream(side):
            self.direct(static_x)
        side.synchronize()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine's other threads may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            outputs = self.direct(static_x)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return graph, static_x, outputs
