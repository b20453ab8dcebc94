"""Fused kernels of vllm-pamer, each with a torch reference that is the CPU path
and the test oracle. Callers use the dispatching functions exported here
(``five_head_vote``, ``cosine_topk``): CUDA tensors run the Triton kernels,
CPU tensors the torch references. The ``*_triton`` launchers run the Triton
kernels directly (on CPU tensors only under TRITON_INTERPRET=1, set before
triton is imported); triton itself is imported on first use, never here."""

from __future__ import annotations

from vllm_pamer.kernels._common import MAX_K, triton_available
from vllm_pamer.kernels.cosine_topk import cosine_topk, cosine_topk_reference, cosine_topk_triton
from vllm_pamer.kernels.five_head_vote import (
    FiveHeadVote,
    five_head_vote,
    five_head_vote_reference,
    five_head_vote_triton,
)

__all__ = [
    "MAX_K",
    "FiveHeadVote",
    "cosine_topk",
    "cosine_topk_reference",
    "cosine_topk_triton",
    "five_head_vote",
    "five_head_vote_reference",
    "five_head_vote_triton",
    "triton_available",
]
