"""Memory store backends (the interface is ``vllm_pamer.core.store``)."""

from __future__ import annotations

import os

from vllm_pamer.core.store import MemoryStore, StoreLimits
from vllm_pamer.stores.sqlite import SqliteStore


def open_store(
    location: str | os.PathLike[str], model_fingerprint: str = "", limits: StoreLimits | None = None
) -> MemoryStore:
    """The store at ``location``: a SQLite file path (the embedded default)."""
    return SqliteStore(location, model_fingerprint=model_fingerprint, limits=limits)


__all__ = ["SqliteStore", "open_store"]
