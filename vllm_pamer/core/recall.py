"""Recall by cosine similarity: scores, Top-K, and a Top-K that changes only
for a reason (so the memory text a request shows stays stable)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_pamer.core.store import Memory

SERVED_STATE_EMBEDDER = "served-model-state"
"""Embedder name of memories embedded by the served model's own final-norm state."""


def cosine_scores(query: np.ndarray, memories: Sequence[Memory]) -> dict[int, float]:
    """Cosine of the query with each memory, by id; zero vectors (query or
    memory) never score. Embeddings of another dimension are an error."""
    q = np.asarray(query, dtype=np.float64).reshape(-1)
    q_norm = np.linalg.norm(q)
    if q_norm == 0:
        return {}
    scores = {}
    for memory in memories:
        e = memory.embedding.astype(np.float64).reshape(-1)
        if e.shape != q.shape:
            raise ValueError(f"memory {memory.id} has embedding dim {e.shape[0]}, query has {q.shape[0]}")
        norm = np.linalg.norm(e)
        if norm > 0:
            scores[memory.id] = float(q @ e / (q_norm * norm))
    return scores


def cosine_top_k(query: np.ndarray, memories: Sequence[Memory], k: int) -> list[Memory]:
    """Top-k memories by cosine; zero vectors never match; ties -> lower id."""
    scores = cosine_scores(query, memories)
    ranked = sorted((m for m in memories if m.id in scores), key=lambda m: (-scores[m.id], m.id))
    return ranked[:k]


def stable_selection(
    scores: dict[int, float], previous: Sequence[int], fresh: Sequence[int], k: int, margin: float
) -> list[int]:
    """Top-k that changes only for a reason: the previous selection is kept
    (members that no longer exist drop out) and a fresh candidate enters only
    by beating the weakest kept member by more than ``margin``, or to fill a
    free place. Returns sorted ids."""
    kept = [i for i in previous if i in scores][:k]
    for candidate in sorted((i for i in fresh if i not in kept), key=lambda i: (-scores[i], i)):
        if len(kept) < k:
            kept.append(candidate)
            continue
        weakest = min(kept, key=lambda i: (scores[i], -i))
        if scores[candidate] > scores[weakest] + margin:
            kept[kept.index(weakest)] = candidate
    return sorted(kept)
