"""vLLM worker extension (``--worker-extension-cls
vllm_pamer.worker.extension.PamerWorkerExtension``; ``vllm-pamer serve``
passes it): the API server reaches the worker's memory rows (``memory.py``)
through vLLM's ``collective_rpc``, which calls these methods on every worker
of every engine. Workers that do not capture (other tensor-parallel ranks)
answer None."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from vllm_pamer.worker.capture import get_worker_capture

logger = logging.getLogger("vllm_pamer.memory")


class PamerWorkerExtension:
    """Neither method raises: an RPC that fails on one worker leaves the other
    workers' replies queued, to answer the next RPC (vLLM's multiprocessing
    executor stops at the first failure)."""

    def pamer_memory_sync(self, session: str, keep: Sequence[int], add: Sequence[tuple[int, bytes]]) -> int | None:
        """Rows of ``session`` after the sync (``WorkerMemory.sync``), None here
        or on a failure."""
        capture = get_worker_capture()
        if capture is None or capture.memory is None:
            return None
        try:
            return capture.memory.sync(session, keep, add)
        except Exception:
            logger.exception("vllm-pamer: a memory sync failed in the worker")
            return None

    def pamer_memory_drop(self, session: str) -> None:
        capture = get_worker_capture()
        if capture is None or capture.memory is None:
            return
        try:
            capture.memory.drop(session)
        except Exception:
            logger.exception("vllm-pamer: a memory drop failed in the worker")
