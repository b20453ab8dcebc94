"""The memory store interface: what a policy may keep per session, and how.

A *memory* is a text (a summary, a cue) with its embedding and the raw blocks
it covers. The guarantees every backend gives (``vllm_pamer/stores/``):

* a memory and its raw blocks are written in one transaction, and a caller
  removes blocks from a request only after ``commit_memory`` returned
  (storage precedes removal, PaMER paper Prop. C.3): a crash leaves the old
  state or the new one;
* every read and write names its session: no call sees another session's rows;
* state that fails validation is discarded and recorded, never repaired
  (PaMER paper Table 15, corrupt state);
* what it keeps is bounded (``StoreLimits``): a commit past a session's cap is
  refused, and retention deletes whole idle sessions, so a memory never
  outlives its raw blocks nor a raw block its memory.

Every method is a coroutine: a backend runs its I/O off the event loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from vllm_pamer.core.blocks import Block, Message

NO_EMBEDDING = np.zeros(1, dtype=np.float32)
"""The embedding of a memory that is never searched by similarity (summary
baselines, SAM pages); its embedder name keeps recall from searching it."""


class StoreError(RuntimeError):
    """A storage operation failed (the caller falls back, nothing is removed)."""


class StoreLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Bounds on what a store keeps. A commit that would pass a session's cap
    is refused with StoreError: the request goes out as it came and nothing is
    removed. The totals are kept by retention, which deletes whole sessions
    (memories, raw blocks and events together), least recently used first,
    and never one used within ``active_s``; when only such sessions are left,
    commits past a total are refused too."""

    session_memories: int = 1024
    """Memories one session may hold."""
    session_raw_bytes: int = 64 * 2**20
    """Bytes (JSON) of the raw blocks one session's memories may cover."""
    session_events: int = 2000
    """Events kept per session; older ones are dropped as new ones come."""
    total_memories: int = 1_000_000
    """Memories of all sessions together."""
    total_raw_bytes: int = 16 * 2**30
    """Bytes of the raw blocks of all sessions together."""
    total_events: int = 5_000_000
    """Events of all sessions together (the oldest are dropped)."""
    idle_s: float = 30 * 86400.0
    """A session unused for this long is deleted whole; 0: never."""
    active_s: float = 3600.0
    """A session used within this long is never deleted to meet a total."""

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if getattr(self, name) < 0:
                raise ValueError(f"store limit {name} must be >= 0")


class StepDetail(msgspec.Struct, frozen=True):
    """Links a memory to one raw block it covers (PaMER+ selects by these)."""

    step: int
    """Position of the block among the blocks the memory archived."""
    block_id: str
    """``core.blocks.block_id`` of the block."""
    tool_names: tuple[str, ...] = ()
    """Tools the block's assistant message called."""
    chars: int = 0
    """Size of the block's JSON."""


class Memory(msgspec.Struct, frozen=True):
    """One committed memory of a session."""

    id: int
    session: str
    summary: str
    """The text a request may show (a summary, a SAM cue)."""
    embedding: np.ndarray
    """float32 vector; a placeholder for memories that are never searched."""
    embedder: str
    """Who embedded it; recall searches only memories of the current embedder."""
    covered_block_ids: tuple[str, ...]
    """Raw blocks this memory archived (stored with it)."""
    step_details: tuple[StepDetail, ...]
    created: float
    """Unix time of the commit."""

    def public(self) -> dict[str, Any]:
        """JSON view (no embedding values)."""
        return {
            "id": self.id,
            "summary": self.summary,
            "embedder": self.embedder,
            "embedding_dim": int(self.embedding.shape[0]),
            "covered_block_ids": list(self.covered_block_ids),
            "step_details": msgspec.to_builtins(self.step_details),
            "created": self.created,
        }


class LoadResult(msgspec.Struct):
    memories: list[Memory]
    """Valid memories of the session, oldest first."""
    discarded: int = 0
    """Rows that failed validation and were discarded (corrupt state)."""


class HeldResponse(msgspec.Struct, frozen=True):
    """A Responses API answer the plugin holds (``server/responses.py``), with
    the whole conversation it ends."""

    session: str
    """The key of the session its conversation is filed under."""
    session_name: str
    """That session's id as clients name it."""
    history: list[Message]
    """Every message of the conversation, oldest first, its own output last."""
    response: dict[str, Any]
    """The response object as it was answered."""


class MemoryStore(ABC):
    """Per-session memories, their raw blocks and an event log."""

    @abstractmethod
    async def load(self, session: str) -> LoadResult:
        """All valid memories of ``session``; invalid rows are discarded."""

    @abstractmethod
    async def commit_memory(
        self,
        session: str,
        summary: str,
        embedding: np.ndarray,
        embedder: str,
        blocks: Sequence[Block],
        step_details: Sequence[StepDetail],
    ) -> int:
        """Store a memory and the raw blocks it covers atomically; its id.
        Raises StoreError (nothing stored) on failure."""

    async def replace_memory_text(self, session: str, memory_id: int, old: str, new: str) -> bool:
        """Replace the text of a committed memory of ``session`` if it still
        reads ``old``; its blocks, embedding and id stay (a summary added after
        its compaction: ``core/policies/pamer/summary_after.py``). False: the
        memory is gone (deleted with its session) or reads otherwise. Raises
        StoreError (nothing changed) on failure."""
        raise StoreError(f"{type(self).__name__} cannot replace a memory's text")

    @abstractmethod
    async def raw_blocks(self, session: str, block_ids: Sequence[str]) -> dict[str, list[Message]]:
        """The stored messages of these blocks of ``session`` (missing ids absent)."""

    @abstractmethod
    async def log_event(self, session: str | None, kind: str, detail: dict[str, Any] | None = None) -> None:
        """Record a decision; a failing event log never fails the request."""

    @abstractmethod
    async def events(self, session: str, limit: int = 100) -> list[dict[str, Any]]:
        """The session's last ``limit`` events, oldest first."""

    @abstractmethod
    async def save_session_state(self, session: str, state: bytes, updated: float) -> None:
        """Keep the server's state of ``session`` (its last vote and captured
        state, encoded by the server), so that any API process or replica, and
        a restarted server, can serve its next request. It replaces a stored
        state made before ``updated`` and never a later one; it is deleted
        with the session. A failing write never fails the request."""

    @abstractmethod
    async def session_state(self, session: str) -> tuple[bytes, float] | None:
        """The stored state of ``session`` and when it was made, or None."""

    async def hold_response(
        self,
        key: str,
        parent: str | None,
        session: tuple[str, str],
        items: Sequence[Message],
        response: dict[str, Any],
    ) -> None:
        """Keep a Responses API answer under ``key`` (its id within its tenant):
        the messages its request added to the conversation the answer held
        under ``parent`` ends (None: a new conversation), its output last, and
        the response as answered; filed under ``session`` (key, id) and deleted
        with it. Raises StoreError (nothing kept) on failure."""
        raise StoreError(f"{type(self).__name__} holds no responses")

    async def held_response(self, key: str) -> HeldResponse | None:
        """The answer held under ``key`` and the whole conversation it ends;
        None when none is held or a part of its conversation is not (never a
        conversation with a gap). Raises StoreError when it cannot be read."""
        return None

    @property
    def shared(self) -> bool:
        """Other servers may write it (a database several replicas use): a
        server reads a session's state from it on every request, not only
        when it has none of its own."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Release the backend's resources."""
