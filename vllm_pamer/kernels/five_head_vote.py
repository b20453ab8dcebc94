"""Five MLP heads (d -> 256 -> 1, exact-erf GELU) and the k-of-5 vote.

``five_head_vote`` is the function callers use; it dispatches on the device of
``x``: CUDA tensors run the fused Triton kernel (``_five_head_vote_triton``,
one launch for the five heads and the vote), CPU tensors run the torch
reference below, which is also the oracle for tests. Triton is imported only
when a Triton path is used, so CPU-only installs never import it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_pamer.kernels._common import triton_available


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
