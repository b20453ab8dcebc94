"""What the dispatchers and the Triton launchers share, importable without
Triton: whether Triton is usable, and the checks of the Top-K inputs."""

from __future__ import annotations

import functools

import torch

MAX_K = 8
"""Results per query the fused Top-K keeps in registers."""


@functools.cache
def triton_available() -> bool:
    """Whether triton imports; without it CUDA tensors fall back to torch."""
    try:
        import triton  # noqa: F401
    except Exception:  # not installed, or a broken install
        return False
    return True


def check_topk_inputs(queries, query_sessions, matrix, row_sessions, k) -> None:
    if queries.dim() != 2 or matrix.dim() != 2 or queries.shape[1] != matrix.shape[1]:
        raise ValueError(
            f"queries [B, e] and matrix [N, e] expected, got {tuple(queries.shape)} and {tuple(matrix.shape)}"
        )
    if query_sessions.shape != (queries.shape[0],) or row_sessions.shape != (matrix.shape[0],):
        raise ValueError("query_sessions must be [B] and row_sessions [N]")
    if query_sessions.dtype != torch.int64 or row_sessions.dtype != torch.int64:
        raise TypeError("query_sessions and row_sessions must be int64")
    if not 1 <= int(k) <= MAX_K:
        raise ValueError(f"k must be in 1..{MAX_K}, got {k}")
    devices = {t.device for t in (queries, query_sessions, matrix, row_sessions)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
