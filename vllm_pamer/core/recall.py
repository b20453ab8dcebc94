"""Recall by cosine similarity: scores, Top-K, the merge of the worker's
Top-K with what it could not see, and a Top-K that changes only for a reason
(so the memory text a request shows stays stable)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
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


class WorkerRecall(msgspec.Struct, frozen=True):
    """The worker's Top-K of a session's memories for a captured state, made at
    capture time over the memory rows it held (``worker/memory.py``)."""

    ids: tuple[int, ...]
    """Memory ids, best first (at most ``limit``; zero vectors never match)."""
    scores: tuple[float, ...]
    """Their cosine with the state."""
    searched: tuple[int, ...]
    """Every memory id of the session the worker held: the others were not scored."""
    limit: int
    """The most ids the worker returns (its kernel's K)."""


def merge_recall(found: WorkerRecall, query: np.ndarray, memories: Sequence[Memory], k: int) -> list[Memory] | None:
    """Top-k of ``memories`` by cosine with ``query`` from the worker's Top-K,
    with the memories it did not hold (added since, or beyond its rows) scored
    here. None when the worker's answer cannot decide it (k above its limit, or
    memories it ranked gone so that one it did not return could now rank)."""
    if k > found.limit:
        return None
    by_id = {m.id: m for m in memories}
    scores = {i: s for i, s in zip(found.ids, found.scores) if i in by_id}
    if len(found.ids) == found.limit and len(scores) < min(k, len(found.ids)):
        return None  # a memory below the worker's K could now be in the top k
    searched = set(found.searched)
    scores.update(cosine_scores(query, [m for m in memories if m.id not in searched]))
    ranked = sorted(scores, key=lambda i: (-scores[i], i))
    return [by_id[i] for i in ranked[:k]]


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
