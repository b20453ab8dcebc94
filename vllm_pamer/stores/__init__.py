"""Memory store backends (the interface is ``vllm_pamer.core.store``)."""

from __future__ import annotations

import os

from vllm_pamer.core.store import MemoryStore, StoreLimits
from vllm_pamer.stores.sqlite import SqliteStore

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(
    location: str | os.PathLike[str], model_fingerprint: str = "", limits: StoreLimits | None = None
) -> MemoryStore:
    """The store at ``location``: a ``postgresql://`` URL (a database several
    replicas share) or a SQLite file path (the embedded default)."""
    if str(location).startswith(POSTGRES_SCHEMES):
        try:
            from vllm_pamer.stores.postgres import PostgresStore
        except ImportError as exc:
            raise RuntimeError(
                f"a postgresql:// store needs the PostgreSQL driver: pip install 'vllm-pamer[postgres]' ({exc})"
            ) from exc
        return PostgresStore(str(location), model_fingerprint=model_fingerprint, limits=limits)
    return SqliteStore(location, model_fingerprint=model_fingerprint, limits=limits)


__all__ = ["SqliteStore", "open_store"]
