"""Which memories a request of the budget schedule shows: chosen at each
compaction (the new one whole, older ones by similarity to the captured
state, within the memory budget) and kept until the next, so the memory text
after the prefix stays the same between compactions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from cachetools import LRUCache

from vllm_pamer.core.policies.base import MAX_TRACKED_SESSIONS
from vllm_pamer.core.policies.pamer.memory import MASKED_KINDS, NEWEST_ALONE, MemoryKind, summary_part
from vllm_pamer.core.recall import cosine_scores
from vllm_pamer.core.store import Memory, MemoryStore


class ShownMemories:
    def __init__(self, kind: MemoryKind, top_k: int, newest_whole: bool = True) -> None:
        self.kind, self.top_k = kind, top_k
        self.newest_whole = newest_whole
        """As ``memory.shown_message`` shows the newest memory: whole, or by its record."""
        # the memory ids each session shows until its next compaction
        self._chosen: LRUCache[str, tuple[int, ...]] = LRUCache(MAX_TRACKED_SESSIONS)

    def keep(self, session: str, ids: tuple[int, ...]) -> None:
        """What a compaction chose, shown until the next."""
        self._chosen[session] = ids

    async def ids(
        self,
        session: str,
        searchable: list[Memory],
        store: MemoryStore,
        budget: int,
        size: Callable[[Memory], int] | None = None,
    ) -> tuple[int, ...]:
        """What the last compaction chose (its event's, where another process
        made it: its new memory is not in ours), else the newest that fit.
        Raises StoreError when the events cannot be read."""
        by_id = {m.id for m in searchable}
        ids = self._chosen.get(session)
        if searchable and (ids is None or max(by_id) not in ids):
            events = await store.events(session, limit=50)
            logged = [e["detail"].get("shown") for e in events if e["kind"] == "compressed"]
            ids = tuple(logged[-1]) if logged and logged[-1] is not None else None
        if ids is None or (by_id and max(by_id) not in ids) or any(i not in by_id for i in ids):
            ids = tuple(m.id for m in self.choose(searchable, None, budget, size))
        self._chosen[session] = ids
        return ids

    def choose(
        self,
        memories: Sequence[Memory],
        query: np.ndarray | None,
        budget: int,
        size: Callable[[Memory], int] | None = None,
    ) -> list[Memory]:
        """Up to ``top_k`` memories within ``budget`` (characters of text, or
        what ``size`` measures): the newest first, then by cosine to ``query``
        (or newest first without one). A masked history (``size``: its tokens)
        shows its newest memories that fit, without gaps."""
        if not memories:
            return []
        newest = max(memories, key=lambda m: m.id)
        scores = cosine_scores(query, memories) if query is not None else {}
        rest = sorted((m for m in memories if m.id != newest.id), key=lambda m: (-scores.get(m.id, 0.0), -m.id))
        chosen: list[Memory] = [newest]
        if self.kind in NEWEST_ALONE:
            return chosen
        if self.kind in MASKED_KINDS and size is not None:
            used = size(newest)
            for memory in rest:  # newest first
                used += size(memory)
                if used > budget:
                    break
                chosen.append(memory)
            return sorted(chosen, key=lambda m: m.id)
        # as stored, with its turns, which take room as its text does; by its record: less its summary
        used = len(newest.summary) - (0 if self.newest_whole else len(summary_part(newest)))
        for memory in rest:
            if len(chosen) == self.top_k:
                break
            chars = len(summary_part(memory))
            # a record alone (no summary under KV pressure) shows nothing once older
            if chars and used + chars <= budget:
                chosen.append(memory)
                used += chars
        return sorted(chosen, key=lambda m: m.id)
