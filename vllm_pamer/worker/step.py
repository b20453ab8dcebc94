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

    def prompt_row(self) -> int | None:
        """Which of this request's logit rows holds its prompt's last token, or
        None when this step samples no such row: the prompt ends in another
        step, or within this step's tokens but not at a sampled one (a request
        resumed after preemption re-prefills its output too). The logit rows
        sit at the last ``logit_rows`` scheduled tokens; with speculative
        decoding a one-token prompt remainder is padded with placeholder drafts,
        so its prompt ends at the first of them."""
        last = self.prompt - self.computed - 1  # the prompt's last token among this step's
        first_sampled = self.scheduled - self.logit_rows
        if self.logit_rows < 1 or not first_sampled <= last < self.scheduled:
            return None
        return last - first_sampled


class StepView(Protocol):
    finished: Iterable[str]
    """Requests that ended before this step (their ids may be reused)."""

    @property
    def prefilling(self) -> bool:
        """Some request of the step has prompt tokens left (else no capture:
        most steps only decode)."""
        ...

    def requests(self) -> list[ScheduledRequest]:
        """The step's requests in row order (unscheduled ones with 0 tokens).
        Read at the forward pass: the runner adds a step's new requests to its
        batch after the step starts."""
        ...

    def extra_args(self, req_id: str) -> Mapping[str, Any]:
        """``SamplingParams.extra_args`` of a request of this step."""
        ...
