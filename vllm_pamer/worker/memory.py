"""Session memories where the recall query is: in the worker, beside the
capture.

PaMER recalls with the state captured at the end of the previous prompt, and
that state exists here, at capture time. ``WorkerMemory`` keeps every
session's memory embeddings in one ``MemoryMatrix`` on the capture device,
allocated whole when the model is built (so vLLM's memory profiling counts it
before it sizes the KV cache), and ``recall`` searches it for all of a step's
captured rows at once (``kernels.cosine_topk``), the Top-K travelling with
each capture record (``channel.CaptureRecord.recall``).

The API server pushes rows through vLLM's ``collective_rpc``
(``worker/extension.py``); the store stays the source of truth, and what
the worker does not hold (not pushed yet, evicted, another width) the API
server scores itself (``core.recall.merge_recall``). When the rows are full,
the least recently used other session's rows make room.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from vllm_pamer.core.recall import WorkerRecall
from vllm_pamer.kernels import MAX_K
from vllm_pamer.worker.memory_matrix import MemoryMatrix

logger = logging.getLogger("vllm_pamer.memory")


class WorkerMemory:
    def __init__(self, dim: int, rows: int, device: torch.device) -> None:
        """``dim``: the served model's hidden size (memories embedded by its
        state); ``rows``: the matrix's fixed size (``Settings.memory_rows``)."""
        self.dim = dim
        # bf16 rows on a GPU halve the bytes held and read (scores accumulate in fp32)
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        self.matrix = MemoryMatrix(dim, device=device, dtype=dtype, capacity=rows, max_capacity=rows)
        self._numbers: dict[str, int] = {}
        self._next_number = 0
        self._rows: OrderedDict[str, dict[int, int]] = OrderedDict()  # session -> memory id -> row, least recent first
        self._lock = threading.Lock()  # RPCs and the step may run on different threads
        self._warned_full = False

    def _number(self, session: str) -> int:
        number = self._numbers.get(session)
        if number is None:
            number = self._numbers[session] = self._next_number
            self._next_number += 1
        return number

    def sync(self, session: str, keep: Sequence[int], add: Sequence[tuple[int, bytes]]) -> int:
        """Make the session's rows the memories ``keep`` plus ``add`` (id,
        float32 embedding): rows of other ids are freed. Embeddings of another
        width are skipped. Returns the rows the session holds."""
        with self._lock:
            rows = self._rows.setdefault(session, {})
            self._rows.move_to_end(session)
            wanted = set(keep) | {memory_id for memory_id, _ in add}
            for memory_id in [i for i in rows if i not in wanted]:
                self.matrix.remove(rows.pop(memory_id))
            number = self._number(session)
            for memory_id, embedding in add:
                vector = np.frombuffer(embedding, dtype="<f4")
                if memory_id in rows or vector.shape[0] != self.dim:
                    continue
                if len(self.matrix) == self.matrix.capacity and not self._evict_one(keep=session):
                    if not self._warned_full:
                        logger.warning(
                            "vllm-pamer: the worker's %d memory rows hold one session's memories; the API server "
                            "scores the rest (raise PAMER_MEMORY_ROWS)",
                            self.matrix.capacity,
                        )
                        self._warned_full = True
                    break
                rows[memory_id] = self.matrix.add(number, torch.from_numpy(vector.copy()))
            if not rows:
                del self._rows[session]
            return len(rows)

    def drop(self, session: str) -> None:
        with self._lock:
            self._drop(session)

    def _drop(self, session: str) -> None:
        for row in self._rows.pop(session, {}).values():
            self.matrix.remove(row)
        self._numbers.pop(session, None)

    def _evict_one(self, keep: str) -> bool:
        """Free the least recently used other session's rows (its API server
        scores its memories until it pushes them again); False: none to free."""
        victim = next((s for s in self._rows if s != keep), None)
        if victim is None:
            return False
        self._drop(victim)
        return True

    def recall(self, sessions: Sequence[str | None], states: torch.Tensor) -> list[WorkerRecall | None]:
        """For each captured state [n, dim] the Top-K of its session's rows
        (None: a session that holds none), in one search."""
        with self._lock:
            wanted = [i for i, s in enumerate(sessions) if s and s in self._rows]
            found: list[WorkerRecall | None] = [None] * len(sessions)
            if not wanted:
                return found
            numbers = [self._numbers[sessions[i]] for i in wanted]  # type: ignore[index]
            for i in wanted:
                self._rows.move_to_end(sessions[i])  # type: ignore[arg-type]
            indices, scores = self.matrix.topk(states[wanted].float(), numbers, MAX_K)
            indices, scores = indices.cpu().tolist(), scores.cpu().tolist()
            for j, i in enumerate(wanted):
                rows = self._rows[sessions[i]]  # type: ignore[index]
                by_row = {row: memory_id for memory_id, row in rows.items()}
                hits = [(by_row[r], s) for r, s in zip(indices[j], scores[j]) if r >= 0 and r in by_row]
                found[i] = WorkerRecall(
                    ids=tuple(h[0] for h in hits),
                    scores=tuple(float(h[1]) for h in hits),
                    searched=tuple(sorted(rows)),
                    limit=MAX_K,
                )
            return found
