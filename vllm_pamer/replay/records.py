"""What a replay records: one ``StepRecord`` per request, one ``RunSummary`` per
policy run, and the report's ``PolicyRow`` per policy (``report.summarize``).

Shared by the client (writes the records), the report (reads them, computes
the rows) and its plots (draw the rows); all plain msgspec structs, stored as
JSON lines / JSON.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any, Literal

import msgspec

Status = Literal["ok", "beyond_window", "error"]


class StepRecord(msgspec.Struct, kw_only=True):
    """One agent request of a replay: what was sent, what came back, what it kept."""

    policy: str
    trajectory_id: str
    trajectory_key: str = ""
    """Unique per trajectory (``trajectories.trajectory_key``); empty in
    records written before it existed, which the report then keys by id."""
    kind: str = ""
    """``tau`` or ``swe`` (how evidence is read, ``evidence.trajectory_kind``)."""
    session_id: str
    step: int
    """Index among the trajectory's decision points (0-based)."""
    message_index: int
    """Index of the recorded next action; the request is ``messages[:message_index]``."""
    status: Status
    """``beyond_window``: the server refused the prompt as longer than the model window."""
    latency_s: float
    ttft_s: float | None = None
    """Seconds to the first token of a streamed answer (None: not streamed, or no token)."""
    error: str = ""
    prompt_tokens_in: int | None = None
    prompt_tokens_out: int | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    cached_tokens: int | None = None
    """Prompt tokens vLLM served from its prefix cache (``usage.prompt_tokens_details``,
    reported when the server runs with ``--enable-prompt-tokens-details``)."""
    pamer: dict[str, Any] | None = None
    """The response's ``pamer`` report without ``messages_sent``."""
    action_tool: str | None = None
    """Name of the tool the model called next (None: it answered in text)."""
    action_arguments: str | None = None
    action_text: str = ""
    action_values: list[str] = []
    """Salient values of the model's action (``salient.action_values``)."""
    needed: int = 0
    """Values the recorded next action needs from the history (``evidence.needed_values``)."""
    available: int | None = None
    """Of those, how many an evidence message of ``messages_sent`` holds (None: nothing echoed)."""
    availability: float | None = None
    """``available / needed``; None when nothing is needed or nothing was echoed."""
    needs: int = 0
    """The recorded next action's needs by the one rule (``evidence.needs``)."""
    readable: int | None = None
    """Of those, how many occur anywhere after the prefix of ``messages_sent`` (None: nothing echoed)."""
    observed: int | None = None
    """Of those, how many occur in its observation text (``evidence.readings``; None: nothing echoed)."""
    chars_original: int = 0
    chars_sent: int | None = None
    chars_share: float | None = None
    inserted: dict[str, int] | None = None
    """Characters of what the policy inserted, by part (``evidence.inserted_spending``; None: nothing echoed)."""
    action_logprob: float | None = None
    """The recorded next action's mean log-probability per token given what was
    sent (``client.action_likelihood``; None: not scored)."""
    action_tokens: int | None = None


class RunSummary(msgspec.Struct, kw_only=True):
    """One policy's run over all trajectories, with the server's counters."""

    policy: str
    trajectories: int
    requests: int
    elapsed_s: float
    kind: str = ""
    """``tau`` / ``swe`` when every trajectory of the run is of that kind, else empty."""
    group: str = ""
    """Which trajectories (a benchmark runs every policy per group, so a partial run compares)."""
    metric_deltas: dict[str, float] = {}
    """After minus before, per Prometheus sample (``name{labels}``)."""
    kv_usage_peak: float | None = None
    """Highest ``vllm:kv_cache_usage_perc`` sampled during the run (0-1)."""
    compactions: dict[str, int] | None = None
    """Its sessions' compactions begun and ended, from the store's events
    (``compactions.COUNTS``); None: not read (runs before it was)."""


class PolicyRow(msgspec.Struct, kw_only=True):
    policy: str
    trajectories: int
    requests: int
    answered: int
    beyond_window: int
    errors: int
    tokens_per_trajectory: float | None = None
    internal_tokens: float = 0.0
    mean_peak_context: float | None = None
    prefill_computed: float | None = None
    peak_kv_usage: float | None = None
    steps_per_min: float | None = None
    """Answered requests a minute (refused ones excluded)."""
    requests_per_min: float | None = None
    """Every request a minute, refused ones included."""
    preemptions: float | None = None
    compactions: int = 0
    """Requests that compacted (action ``compressed``)."""
    cache_break_tokens: int = 0
    """Prefix-cached tokens those compactions made the engine compute again
    (the ``schedule`` report; 0 for policies without one)."""
    evidence_availability: float | None = None
    """The one-sided rule's share (``evidence.evidence_messages``)."""
    chars_share: float | None = None
    over_recency: float | None = None
    """The one-sided share minus recency's at the same chars share."""
    needs: int = 0
    """Needs by the one rule over every request (refused ones included)."""
    readable: float | None = None
    """Share of the needs readable after the prefix (a refused request reads none)."""
    observed: float | None = None
    """Share of the needs in observation text after the prefix (a refused request observes none)."""
    readable_over_recency: float | None = None
    observed_over_recency: float | None = None
    common: int = 0
    """Requests every policy of the report answered (and echoed)."""
    readable_common: float | None = None
    """``readable`` on those requests only (no refusal in it)."""
    observed_common: float | None = None
    prefill_common: float | None = None
    """``prefill_computed`` less what the answered requests outside the common
    ones computed (their prompt tokens not served from the prefix cache); a
    policy's internal requests stay in it. None without cached-token counts."""
    inserted_chars: float | None = None
    """Mean characters a policy inserted per answered request (memories, placeholders)."""
    spending: dict[str, float] | None = None
    """Shares of those characters by part (``evidence.INSERTED_PARTS``)."""
    scored: int = 0
    """Requests whose recorded action was scored (``--likelihood``)."""
    action_logprob: float | None = None
    """Mean over its scored requests of the recorded action's log-probability per token."""
    logprob_lost: float | None = None
    """On the requests ``none`` and this policy both scored: ``none``'s mean minus this policy's."""
    logprob_lost_recency: float | None = None
    """What recency (the ``recent_k`` / ``sliding_window`` rows of the report) loses at this row's chars share."""
    agree_tool: float | None = None
    agree_args: float | None = None
    cache_hits: float | None = None
    recall_changes: float | None = None
    recalls: int = 0


def key_of(record: StepRecord) -> str:
    """The record's trajectory, unique (its id for records from before keys)."""
    return record.trajectory_key or record.trajectory_id


def _open(path: str | Path, mode: str):
    """Plain or gzip (``.gz``) JSON lines."""
    return gzip.open(path, mode) if str(path).endswith(".gz") else open(path, mode)


def write_records(path: str | Path, records: list[StepRecord]) -> None:
    encoder = msgspec.json.Encoder()
    with _open(path, "wb") as handle:
        for record in records:
            handle.write(encoder.encode(record) + b"\n")


def read_records(path: str | Path) -> list[StepRecord]:
    decoder = msgspec.json.Decoder(StepRecord)
    with _open(path, "rb") as handle:
        return [decoder.decode(line) for line in handle.read().splitlines() if line.strip()]


def write_runs(path: str | Path, runs: list[RunSummary]) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(runs)))


def read_runs(path: str | Path) -> list[RunSummary]:
    return msgspec.json.decode(Path(path).read_bytes(), type=list[RunSummary])
