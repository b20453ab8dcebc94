"""Fused kernels of vllm-pamer, each with a torch reference that is the CPU path
and the test oracle. Callers use the dispatching functions exported here."""

from kernels.five_head_vote import five_head_vote, five_head_vote_reference

__all__ = ["five_head_vote", "five_head_vote_reference"]
