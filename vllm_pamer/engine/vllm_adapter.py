"""The one place that touches vLLM's worker internals (v0.32, V1 model runner).

If a vLLM upgrade moves things, this file, ``batch.py`` (the runner's input
batch) and ``models.py`` are what change:
* ``install_runner_hook`` brackets ``GPUModelRunner.execute_model`` (the CPU
  runner inherits it) so the capture knows the step's scheduler output;
* ``capture_rank`` tells whether this worker publishes (one rank of a
  tensor-parallel group, the last pipeline stage: where logits exist).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_pamer.engine.capture import get_worker_capture

_HOOK_FLAG = "_vllm_pamer_hook"


def capture_rank() -> bool:
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0 and get_pp_group().is_last_rank
    except Exception:  # distributed state not initialised: single process
        return True


def install_runner_hook() -> None:
    """Idempotent: wrap execute_model once per process."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.execute_model
    if getattr(original, _HOOK_FLAG, False):
        return

    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any):
        capture = get_worker_capture()
        if capture is None:
            return original(self, scheduler_output, *args, **kwargs)
        capture.arm(self, scheduler_output)
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            capture.disarm()

    setattr(execute_model, _HOOK_FLAG, True)
    GPUModelRunner.execute_model = execute_model
