"""Five MLP heads (d -> 256 -> 1, exact-erf GELU) and the k-of-5 vote.

``five_head_vote`` is the function callers use; it dispatches on the device of
``x``. The torch reference below is the CPU path and the oracle for tests. A
fused Triton kernel for CUDA is tracked separately; until it lands, CUDA
tensors run the same reference (it is already batched: two einsums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    logits. Returns logits [B, H] fp32, votes [B] int32, decision [B] bool."""
    hidden = torch.einsum("bd,hdw->bhw", x.float(), w1.float()) + b1.float()
    logits = torch.einsum("bhw,hw->bh", F.gelu(hidden), w2.float()) + b2.float()
    votes = (logits > thresholds.float()).sum(dim=-1, dtype=torch.int32)
    return logits, votes, votes >= min_votes


def five_head_vote(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    thresholds: torch.Tensor,
    min_votes: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatching entry point (see module docstring)."""
    return five_head_vote_reference(x, w1, b1, w2, b2, thresholds, min_votes)
