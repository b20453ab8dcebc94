"""The server's recall index agrees with the pure-core cosine Top-K and
follows the store (new memories appear, discarded ones vanish)."""

from __future__ import annotations

import numpy as np

from vllm_pamer.core.recall import cosine_top_k
from vllm_pamer.core.store import Memory
from vllm_pamer.server.memory_index import MemoryIndex


def memories(session: str, n: int, dim: int, seed: int) -> list[Memory]:
    rng = np.random.default_rng(seed)
    return [
        Memory(i + 100 * seed, session, f"m{i}", rng.standard_normal(dim).astype(np.float32), "e", ("b",), (), 0.0)
        for i in range(n)
    ]


def test_matches_core_top_k_and_isolates_sessions():
    index = MemoryIndex(device="cpu")
    a, b = memories("a", 9, 32, seed=1), memories("b", 5, 32, seed=2)
    query = np.random.default_rng(3).standard_normal(32).astype(np.float32)
    index.sync("b", b)
    for k in (1, 3, 8, 12):
        assert [m.id for m in index.top_k("a", query, a, k)] == [m.id for m in cosine_top_k(query, a, k)]
    assert {m.session for m in index.top_k("b", query, b, 3)} == {"b"}


def test_follows_the_store():
    index = MemoryIndex(device="cpu")
    a = memories("a", 6, 16, seed=4)
    query = a[2].embedding.copy()
    assert index.top_k("a", query, a, 1)[0].id == a[2].id
    remaining = [m for m in a if m.id != a[2].id]  # discarded as corrupt, say
    assert a[2].id not in [m.id for m in index.top_k("a", query, remaining, 6)]
    index.drop_session("a")
    assert [m.id for m in index.top_k("a", query, a, 1)] == [a[2].id]  # rebuilt from the store


def test_evicted_sessions_free_their_rows():
    from vllm_pamer.server.sessions import SessionRegistry

    index = MemoryIndex(device="cpu")
    registry = SessionRegistry(max_sessions=2, on_evict=index.drop_session)
    for session in ("a", "b", "c"):
        registry.touch(session)
        index.sync(session, memories(session, 3, 8, seed=ord(session)))
    assert registry.get("a") is None
    assert sum(len(m) for m in index._matrices.values()) == 6  # a's 3 rows freed
