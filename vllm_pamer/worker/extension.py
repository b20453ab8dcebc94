"""vLLM worker extension (``--worker-extension-cls
vllm_pamer.worker.extension.PamerWorkerExtension``; ``vllm-pamer serve``
passes it): the API server reaches the worker's memory rows (``memory.py``)
through vLLM's ``collective_rpc``, which calls these methods on every worker
of every engine. Workers that do not capture (other tensor-parallel ranks)
answer None."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_pamer.worker.capture import get_worker_capture


class PamerWorkerExtension:
    def pamer_memory_sync(self, session: str, keep: Sequence[int], add: Sequence[tuple[int, bytes]]) -> int | None:
        """Rows of ``session`` after the sync (``WorkerMemory.sync``), None here."""
        capture = get_worker_capture()
        if capture is None or capture.memory is None:
            return None
        return capture.memory.sync(session, keep, add)

    def pamer_memory_drop(self, session: str) -> None:
        capture = get_worker_capture()
        if capture is not None and capture.memory is not None:
            capture.memory.drop(session)
