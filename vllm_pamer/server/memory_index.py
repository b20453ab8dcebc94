"""Recall search over the memory matrix, in the API-server process: the store
stays the source of truth, the matrix mirrors each active session's memories on the device.

``sync`` makes the session's rows match the memories just loaded from the
store (new memories appended, discarded ones removed); ``top_k`` searches them
with ``kernels.cosine_topk`` (Triton on CUDA, torch on CPU); ``drop_session``
frees a session's rows when it is evicted.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from vllm_pamer.core.recall import cosine_top_k
from vllm_pamer.core.store import Memory
from vllm_pamer.kernels import MAX_K
from vllm_pamer.server.memory_matrix import MemoryMatrix


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class MemoryIndex:
    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self._matrices: dict[int, MemoryMatrix] = {}  # one per embedding dim
        self._session_numbers: dict[str, int] = {}
        self._rows: dict[tuple[str, int], tuple[int, int]] = {}  # (session, memory id) -> (dim, row)
        self._lock = threading.Lock()

    def _session_number(self, session: str) -> int:
        return self._session_numbers.setdefault(session, len(self._session_numbers))

    def sync(self, session: str, memories: Sequence[Memory]) -> None:
        with self._lock:
            wanted = {m.id: m for m in memories}
            for (s, memory_id), (dim, row) in list(self._rows.items()):
                if s == session and memory_id not in wanted:
                    self._matrices[dim].remove(row)
                    del self._rows[(s, memory_id)]
            number = self._session_number(session)
            for memory in memories:
                if (session, memory.id) in self._rows:
                    continue
                dim = int(memory.embedding.shape[0])
                matrix = self._matrices.get(dim)
                if matrix is None:
                    matrix = self._matrices[dim] = MemoryMatrix(dim, device=self.device)
                row = matrix.add(number, torch.from_numpy(np.ascontiguousarray(memory.embedding, dtype=np.float32)))
                self._rows[(session, memory.id)] = (dim, row)

    def top_k(self, session: str, query: np.ndarray, memories: Sequence[Memory], k: int) -> list[Memory]:
        """The k memories (of ``memories``, this session's) closest to ``query``."""
        if not memories:
            return []
        if k > MAX_K:  # beyond the kernel's register budget: plain numpy
            return cosine_top_k(query, memories, k)
        self.sync(session, memories)
        query = np.asarray(query, dtype=np.float32).reshape(-1)
        with self._lock:
            matrix = self._matrices.get(int(query.shape[0]))
            if matrix is None:
                raise ValueError(f"no memory has the query's embedding dim {query.shape[0]}")
            indices, _ = matrix.topk(torch.from_numpy(query), [self._session_numbers[session]], k)
            by_row = {row: mid for (s, mid), (dim, row) in self._rows.items() if s == session and dim == query.shape[0]}
        by_id = {m.id: m for m in memories}
        return [by_id[by_row[int(row)]] for row in indices[0].tolist() if row >= 0 and by_row.get(int(row)) in by_id]

    def drop_session(self, session: str) -> None:
        with self._lock:
            number = self._session_numbers.pop(session, None)
            if number is None:
                return
            for matrix in self._matrices.values():
                matrix.remove_session(number)
            for key in [key for key in self._rows if key[0] == session]:
                del self._rows[key]
