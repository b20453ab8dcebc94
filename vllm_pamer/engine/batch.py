"""How a step's requests sit in the V1 model runner's input batch (vLLM 0.32).

The capture (logits rows) and the layer taps (token rows) both walk the batch
in its order; this is the one place that reads the runner's batch fields, so
an engine upgrade that renames them changes this file only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple


class ScheduledRequest(NamedTuple):
    req_id: str
    scheduled: int
    """Tokens of this request in this step (its token rows)."""
    draft_tokens: int
    """Speculative draft tokens (extra rows after the scheduled ones)."""
    computed: int
    """Tokens computed before this step (prefix-cache hits included)."""
    prompt: int
    """Prompt length."""

    @property
    def completes_prompt(self) -> bool:
        """The prompt prefill ends in this step."""
        return self.computed < self.prompt <= self.computed + self.scheduled


def scheduled_requests(runner: Any, scheduler_output: Any) -> Iterator[ScheduledRequest]:
    """The runner's batch in row order (unscheduled requests with 0 tokens)."""
    batch = runner.input_batch
    scheduled = scheduler_output.num_scheduled_tokens
    drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", {}) or {}
    for index, req_id in enumerate(batch.req_ids):
        yield ScheduledRequest(
            req_id,
            int(scheduled.get(req_id, 0)),
            len(drafts.get(req_id, ())),
            int(batch.num_computed_tokens_cpu[index]),
            int(batch.num_prompt_tokens[index]),
        )
