"""Memories as the store returns them, with random ``DIM``-wide embeddings,
for the recall tests (numpy and the pure core only: the GPU check machine
runs them without vLLM)."""

from __future__ import annotations

import numpy as np

from vllm_pamer.core.store import Memory

DIM = 24


def memories(session: str, n: int, seed: int, start: int = 1) -> list[Memory]:
    """``n`` memories of ``session`` (ids from ``start``) with random embeddings."""
    rng = np.random.default_rng(seed)
    return [
        Memory(i, session, f"m{i}", rng.standard_normal(DIM).astype(np.float32), "served-model-state", (), (), 0.0)
        for i in range(start, start + n)
    ]
