"""The V1 model runner (``vllm/v1/worker/gpu_model_runner.py``; the
CPU runner inherits it): the worker's touch points.

* ``install_runner_hook`` brackets ``GPUModelRunner.execute_model`` so the
  worker capture knows the step (``V1Step``, the neutral view of
  ``vllm_pamer/worker/step.py`` over the runner's input batch);
* ``capture_rank`` tells whether this worker publishes (one rank of a
  tensor-parallel group, the last pipeline stage: where logits exist).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_pamer.worker.capture import get_worker_capture
from vllm_pamer.worker.step import ScheduledRequest

_HOOK_FLAG = "_vllm_pamer_hook"


class V1Step:
    """One step of the V1 runner: its input batch in row order."""

    def __init__(self, runner: Any, scheduler_output: Any) -> None:
        self.runner = runner
        self.scheduler_output = scheduler_output
        self.finished: Iterable[str] = getattr(scheduler_output, "finished_req_ids", ()) or ()

    @property
    def prefilling(self) -> bool:
        batch = self.runner.input_batch
        n = len(batch.req_ids)
        return bool((batch.num_computed_tokens_cpu[:n] < batch.num_prompt_tokens[:n]).any())

    def requests(self) -> list[ScheduledRequest]:
        batch = self.runner.input_batch
        scheduled = self.scheduler_output.num_scheduled_tokens
        drafts = getattr(self.scheduler_output, "scheduled_spec_decode_tokens", {}) or {}
        return [
            ScheduledRequest(
                req_id,
                int(scheduled.get(req_id, 0)),
                1 + len(drafts.get(req_id, ())),
                int(batch.num_computed_tokens_cpu[index]),
                int(batch.num_prompt_tokens[index]),
            )
            for index, req_id in enumerate(batch.req_ids)
        ]

    def extra_args(self, req_id: str) -> Mapping[str, Any]:
        state = self.runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        return (getattr(params, "extra_args", None) or {}) if params else {}


def check_runner(vllm_config: Any, model_cls: type) -> str | None:
    """Why this V1 engine cannot be captured, or None: every V1 mode can."""
    return None


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
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        capture = get_worker_capture()
        if capture is None:
            return original(self, scheduler_output, *args, **kwargs)
        capture.begin_step(V1Step(self, scheduler_output))
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            capture.end_step()

    setattr(execute_model, _HOOK_FLAG, True)
    GPUModelRunner.execute_model = execute_model
