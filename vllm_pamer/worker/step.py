"""The worker glue's neutral view of one engine step, filled in by the
adapter of the runner vLLM uses (``vllm_pamer/adapters/``): which requests
the step holds, in the order of their rows, and their extra args."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Protocol


class ScheduledRequest(NamedTuple):
    req_id: str
    scheduled: int
    """Tokens of this request in this step (its token rows)."""
    logit_rows: int
    """Rows this request owns among the rows sampling reads: one, plus one per
    speculative draft token; the last is at its last scheduled token."""
    computed: int
    """Tokens computed before this step (prefix-cache hits included)."""
    prompt: int
    """Prompt length."""

    @property
    def completes_prompt(self) -> bool:
        """The prompt prefill ends in this step, at its last scheduled token (a
        request resumed after preemption re-prefills its output too: a chunk
        running past the prompt samples no prompt state)."""
        return self.computed < self.prompt == self.computed + self.scheduled


class StepView(Protocol):
    finished: Iterable[str]
    """Requests that ended before this step (their ids may be reused)."""

    def requests(self) -> list[ScheduledRequest]:
        """The step's requests in row order (unscheduled ones with 0 tokens).
        Read at the forward pass: the runner adds a step's new requests to its
        batch after the step starts."""
        ...

    def extra_args(self, req_id: str) -> Mapping[str, Any]:
        """``SamplingParams.extra_args`` of a request of this step."""
        ...
