"""The memory matrix: every session's memory embeddings in one device-resident
matrix, searched by ``kernels.cosine_topk`` for all queries of a batch at once.

Layout. ``matrix`` [capacity, dim] holds one embedding per row, L2-normalised
on insert (a zero embedding stays zero and never matches); ``row_sessions``
[capacity] int64 holds each row's session, -1 for a free row. Rows
[0, size) are the ones the search scans. Capacity grows by doubling
(amortised O(1) insert) up to ``max_capacity``, when one is given (the
worker's matrix is allocated whole at start, inside the engine's memory
budget, and never grows: ``MatrixFull``); a removed row is zeroed, marked free and reused
first (lowest free row first), and trailing free rows shrink ``size`` so the
scan stops at the last live row.

Bookkeeping (free rows, session -> rows, row -> session) is kept on the host, so
add/remove never read the device: no host synchronisation, on CPU or CUDA.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
import torch.nn.functional as F


class MatrixFull(RuntimeError):
    """Every row of a matrix that may not grow is in use."""


class MemoryMatrix:
    def __init__(
        self,
        dim: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        capacity: int = 1024,
        max_capacity: int | None = None,
    ) -> None:
        """``dtype`` is the storage type (bf16 halves the bytes each search
        reads on a GPU; scores still accumulate in fp32). ``max_capacity``:
        rows it may grow to (None: no limit)."""
        if dim <= 0 or capacity <= 0:
            raise ValueError("dim and capacity must be positive")
        if max_capacity is not None and max_capacity < capacity:
            raise ValueError("max_capacity must be at least capacity")
        self.max_capacity = max_capacity
        self.dim = int(dim)
        self.device = torch.device(device)
        self.dtype = dtype
        self._matrix = torch.zeros((capacity, self.dim), dtype=dtype, device=self.device)
        self.device = self._matrix.device  # "cuda" resolved to its index now, whichever thread asks later
        self._sessions = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self._size = 0
        self._free_heap: list[int] = []  # may hold stale entries (rows trimmed off the end)
        self._free: set[int] = set()
        self._session_rows: dict[int, set[int]] = {}
        self._row_session: dict[int, int] = {}

    # -- views -----------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._matrix.shape[0]

    @property
    def size(self) -> int:
        """Rows the search scans: one past the highest live row."""
        return self._size

    @property
    def matrix(self) -> torch.Tensor:
        return self._matrix[: self._size]

    @property
    def row_sessions(self) -> torch.Tensor:
        return self._sessions[: self._size]

    def __len__(self) -> int:
        return len(self._row_session)

    def rows(self, session: int) -> list[int]:
        return sorted(self._session_rows.get(session, ()))

    def session_of(self, row: int) -> int:
        return self._row_session[row]

    # -- updates ---------------------------------------------------------------
    def add(self, session: int, embedding: torch.Tensor) -> int:
        """Store ``embedding`` [dim] for ``session`` (an int >= 0); returns its row."""
        session = int(session)
        if session < 0:
            raise ValueError("session numbers are >= 0 (-1 marks a free row)")
        embedding = torch.as_tensor(embedding)
        if embedding.shape != (self.dim,):
            raise ValueError(f"embedding must have shape ({self.dim},), got {tuple(embedding.shape)}")
        row = self._take_row()
        unit = F.normalize(embedding.to(device=self.device, dtype=torch.float32), dim=0)  # zero stays zero
        self._matrix[row] = unit.to(self.dtype)
        self._sessions[row] = session
        self._session_rows.setdefault(session, set()).add(row)
        self._row_session[row] = session
        return row

    def remove(self, row: int) -> None:
        session = self._row_session.pop(row)  # KeyError: not a live row
        rows = self._session_rows[session]
        rows.discard(row)
        if not rows:
            del self._session_rows[session]
        self._matrix[row].zero_()
        self._sessions[row] = -1
        self._free.add(row)
        heapq.heappush(self._free_heap, row)
        while self._size and (self._size - 1) in self._free:  # trim trailing free rows
            self._size -= 1
            self._free.discard(self._size)

    def remove_session(self, session: int) -> int:
        """Free every row of ``session``; returns how many."""
        rows = self.rows(session)
        for row in rows:
            self.remove(row)
        return len(rows)

    # -- search ----------------------------------------------------------------
    def topk(
        self,
        queries: torch.Tensor,
        query_sessions: torch.Tensor | Sequence[int],
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For each query [B, dim] the k best rows of its own session by cosine
        similarity: (indices [B, k] int64, -1 padded; scores [B, k] fp32, -inf
        padded). See ``kernels.cosine_topk``."""
        from vllm_pamer.kernels import cosine_topk

        queries = torch.as_tensor(queries).to(self.device)
        if queries.dim() == 1:
            queries = queries[None]
        query_sessions = torch.as_tensor(query_sessions, dtype=torch.int64).to(self.device).reshape(-1)
        return cosine_topk(queries, query_sessions, self.matrix, self.row_sessions, k)

    # -- internals -------------------------------------------------------------
    def _take_row(self) -> int:
        while self._free_heap:
            row = heapq.heappop(self._free_heap)
            if row in self._free and row < self._size:
                self._free.discard(row)
                return row
        if self._size == self.capacity:
            if self.max_capacity is not None and self.capacity >= self.max_capacity:
                raise MatrixFull(f"all {self.capacity} rows of the memory matrix are in use")
            self._grow()
        self._size += 1
        return self._size - 1

    def _grow(self) -> None:
        capacity = 2 * self.capacity
        if self.max_capacity is not None:
            capacity = min(capacity, self.max_capacity)
        matrix = torch.zeros((capacity, self.dim), dtype=self.dtype, device=self.device)
        sessions = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        matrix[: self._size] = self._matrix[: self._size]
        sessions[: self._size] = self._sessions[: self._size]
        self._matrix, self._sessions = matrix, sessions
