"""Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``, vLLM's
GPU default): the worker's touch points. Three methods are wrapped, none is
changed inside (that file asks to stay minimal):

* ``add_requests``: V2 keeps no sampling parameters per request, so the extra
  args of each new request are remembered here (a request resumed after
  preemption comes back as a new one, with its parameters);
* ``finish_requests``: they are forgotten (finished and preempted requests);
  finished ids go to the capture with the next step, as V1's do;
* ``sample``: brackets the step. ``sample`` hands ``compute_logits`` the rows
  ``hidden_states[input_batch.logits_indices]``, ``cu_num_logits`` of them per
  request in ``input_batch.req_ids`` order, the last at the request's last
  scheduled token: ``V2Step`` is the neutral view (``worker/step.py``) of that.

Batch-sharded sampling computes logits through ``compute_logits_local`` on a
rank's share: ``check_runner`` refuses it at start-up.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from vllm_pamer.worker.capture import get_worker_capture
from vllm_pamer.worker.step import ScheduledRequest

_HOOK_FLAG = "_vllm_pamer_hook"


class V2Step:
    """One sampling call of the V2 runner over ``input_batch``."""

    def __init__(
        self, runner: Any, input_batch: Any, extra_args: Mapping[str, Mapping[str, Any]], finished: Iterable[str]
    ) -> None:
        self.runner = runner
        self.input_batch = input_batch
        self._extra_args = extra_args
        self.finished: Iterable[str] = finished

    @property
    def prefilling(self) -> bool:
        return bool(self.input_batch.has_prefill)

    def _cu_num_logits(self) -> np.ndarray:
        batch = self.input_batch
        if getattr(self.runner, "adaptive_verification", None) is not None and batch.num_draft_tokens:
            # drafts were reallocated on the device: the host copy is an upper bound
            return batch.cu_num_logits.cpu().numpy()
        return batch.cu_num_logits_np

    def requests(self) -> list[ScheduledRequest]:
        batch = self.input_batch
        cu = self._cu_num_logits()
        prompt_len = self.runner.req_states.prompt_len.np
        return [
            ScheduledRequest(
                req_id,
                int(batch.num_scheduled_tokens[i]),
                int(cu[i + 1] - cu[i]),
                int(batch.num_computed_tokens_np[i]),
                int(prompt_len[batch.idx_mapping_np[i]]),
            )
            for i, req_id in enumerate(batch.req_ids[: batch.num_reqs])
        ]

    def extra_args(self, req_id: str) -> Mapping[str, Any]:
        return self._extra_args.get(req_id, {})


class _RunnerState:
    """What the wrappers keep per runner: new requests' extra args and the ids
    finished since the last step."""

    def __init__(self) -> None:
        self.extra_args: dict[str, Mapping[str, Any]] = {}
        self.finished: set[str] = set()

    def add(self, scheduler_output: Any) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            extra = (getattr(params, "extra_args", None) or {}) if params is not None else {}
            if extra:
                self.extra_args[new.req_id] = dict(extra)
            else:
                self.extra_args.pop(new.req_id, None)

    def finish(self, scheduler_output: Any) -> None:
        finished = set(scheduler_output.finished_req_ids)
        for req_id in finished | set(getattr(scheduler_output, "preempted_req_ids", None) or ()):
            self.extra_args.pop(req_id, None)
        self.finished |= finished

    def take_finished(self) -> set[str]:
        finished, self.finished = self.finished, set()
        return finished


def _state(runner: Any) -> _RunnerState:
    state = getattr(runner, "_pamer_state", None)
    if state is None:
        state = _RunnerState()
        runner._pamer_state = state
    return state


def check_runner(vllm_config: Any, model_cls: type) -> str | None:
    """Why this V2 engine cannot be captured, or None."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "enable_batch_sharded_sampling", False) and hasattr(model_cls, "compute_logits_local"):
        return (
            "batch-sharded sampling computes logits on each rank's share of the requests, out of the rows' order; "
            "start the engine without --enable-batch-sharded-sampling"
        )
    return None


def install_runner_hook() -> None:
    """Idempotent: wrap the three methods once per process."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    if getattr(GPUModelRunner.sample, _HOOK_FLAG, False):
        return
    add_requests, finish_requests, sample = (
        GPUModelRunner.add_requests,
        GPUModelRunner.finish_requests,
        GPUModelRunner.sample,
    )

    @functools.wraps(add_requests)
    def add_requests_hook(self: Any, scheduler_output: Any) -> None:
        _state(self).add(scheduler_output)
        add_requests(self, scheduler_output)

    @functools.wraps(finish_requests)
    def finish_requests_hook(self: Any, scheduler_output: Any) -> None:
        _state(self).finish(scheduler_output)
        finish_requests(self, scheduler_output)

    @functools.wraps(sample)
    def sample_hook(self: Any, hidden_states: Any, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        capture = get_worker_capture()
        if capture is None:
            return sample(self, hidden_states, input_batch, *args, **kwargs)
        state = _state(self)
        capture.begin_step(V2Step(self, input_batch, state.extra_args, state.take_finished()))
        try:
            return sample(self, hidden_states, input_batch, *args, **kwargs)
        finally:
            capture.end_step()

    for name, hook in (
        ("add_requests", add_requests_hook),
        ("finish_requests", finish_requests_hook),
        ("sample", sample_hook),
    ):
        setattr(hook, _HOOK_FLAG, True)
        setattr(GPUModelRunner, name, hook)
