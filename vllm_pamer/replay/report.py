"""Per-policy figures of a replay: a markdown table, JSON, records and a plot.

From the per-request records and each run's counter deltas, per policy:

* **tokens / trajectory** (paper eq. 45): input + output tokens of every
  request, plus the plugin's own engine requests (summaries, embeddings, ...;
  ``vllm_pamer_internal_*`` deltas, which are global, so they enter the mean,
  not a per-trajectory split), divided by the trajectories replayed;
* **mean peak context** (eq. 46): the largest ``prompt_tokens_out`` of each
  trajectory, averaged over trajectories;
* **prefill computed**: prompt tokens the engine actually computed over the
  run, not served from the prefix cache (``prometheus.prefill_computed``);
* **peak KV**: the highest sampled ``vllm:kv_cache_usage_perc``;
* **steps/min**: requests answered per minute of the run;
* **preemptions**: requests vLLM evicted to free KV-cache space (and computed
  again later), ``vllm:num_preemptions`` over the run;
* **evidence availability** and **chars share**: pooled over requests
  (needed values kept / needed values; characters sent / characters of the
  full histories), the same pooling as ``evidence.recency_frontier``; a
  request refused as longer than the window keeps none of its needed values
  (the model reads nothing), while chars share covers answered requests;
* **next-action agreement with ``none``** (when it ran): on the steps both
  answered, the share where the model called the same tool (or both answered
  in text), and the mean Jaccard overlap of the two actions' salient values;
* **beyond window**: requests the server refused as longer than the window;
* **cache hits**: prompt tokens vLLM served from its prefix cache, per request
  (``usage.prompt_tokens_details``, with ``--enable-prompt-tokens-details``),
  over all prompt tokens of the replay's requests;
* **recall changes**: of the requests that showed recalled memories after an
  earlier recall in the same session, the share that showed a different list
  (each change rewrites the prompt right after the prefix, so the prefix cache
  loses the rest);
* **over recency** (given the trajectories): evidence availability minus what
  plain recency (``recent_k``, the prefix and the last k blocks) keeps at the
  same chars share on the same requests (``evidence.recency_at``), in points.
  Above zero, a policy's rewriting keeps more of what the next action needs
  than dropping old blocks would for the same characters; ``recent_k`` itself
  reads about zero, a check on the measurement.

Several runs of one policy (a benchmark that runs every policy per group of
trajectories) are merged: times, counters and trajectories add up.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import mean
from typing import Any

import msgspec

from vllm_pamer.replay import prometheus
from vllm_pamer.replay.compactions import compaction_table
from vllm_pamer.replay.evidence import FrontierPoint, Reading, recency_at, recency_frontier
from vllm_pamer.replay.latency import latency_notes, latency_table
from vllm_pamer.replay.paired import paired_rows, paired_table
from vllm_pamer.replay.plots import plot_all
from vllm_pamer.replay.readings import add_common, add_likelihood
from vllm_pamer.replay.records import PolicyRow, RunSummary, StepRecord, key_of, write_records, write_runs
from vllm_pamer.replay.spending import SPENDING_NOTES, add_spending, spending_table

BASELINE = "none"


def jaccard(a: Sequence[str], b: Sequence[str]) -> float:
    """Overlap of two value sets; two empty sets agree fully."""
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def recall_changes(records: Sequence[StepRecord]) -> tuple[int, int]:
    """(changed, compared): requests whose recalled list differs from the
    same session's previous recall, among those that had a previous recall."""
    last: dict[str, list[int]] = {}
    changed = compared = 0
    for r in sorted(records, key=lambda r: (r.session_id, r.step)):
        shown = (r.pamer or {}).get("recalled") if r.status == "ok" else None
        if shown is None:
            continue
        if r.session_id in last:
            compared += 1
            changed += shown != last[r.session_id]
        last[r.session_id] = shown
    return changed, compared


def merge_runs(runs: Sequence[RunSummary]) -> list[RunSummary]:
    """One summary per policy, in first-run order: trajectories, requests,
    time and counter deltas add up, the KV peak is the highest."""
    merged: dict[str, RunSummary] = {}
    for run in runs:
        into = merged.get(run.policy)
        if into is None:
            merged[run.policy] = msgspec.structs.replace(run, metric_deltas=dict(run.metric_deltas), group="")
            continue
        into.trajectories += run.trajectories
        into.requests += run.requests
        into.elapsed_s += run.elapsed_s
        for key, value in run.metric_deltas.items():
            into.metric_deltas[key] = into.metric_deltas.get(key, 0.0) + value
        peaks = [p for p in (into.kv_usage_peak, run.kv_usage_peak) if p is not None]
        into.kv_usage_peak = max(peaks) if peaks else None
        into.kind = into.kind if into.kind == run.kind else ""
    return list(merged.values())


def policy_row(
    records: Sequence[StepRecord], run: RunSummary, baseline: Sequence[StepRecord] | None = None
) -> PolicyRow:
    ok = [r for r in records if r.status == "ok"]
    row = PolicyRow(
        policy=run.policy,
        trajectories=run.trajectories,
        requests=len(records),
        answered=len(ok),
        beyond_window=sum(r.status == "beyond_window" for r in records),
        errors=sum(r.status == "error" for r in records),
        peak_kv_usage=run.kv_usage_peak,
    )
    deltas = run.metric_deltas
    row.internal_tokens = (prometheus.total(deltas, prometheus.INTERNAL_PROMPT) or 0.0) + (
        prometheus.total(deltas, prometheus.INTERNAL_COMPLETION) or 0.0
    )
    request_tokens = sum(
        (r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_tokens_out or 0)
        + (r.usage_completion_tokens or 0)
        for r in ok
    )
    row.tokens_per_trajectory = _ratio(request_tokens + row.internal_tokens, run.trajectories)

    peaks: dict[str, int] = {}
    for r in ok:
        if r.prompt_tokens_out is not None:
            peaks[key_of(r)] = max(peaks.get(key_of(r), 0), r.prompt_tokens_out)
    row.mean_peak_context = mean(peaks.values()) if peaks else None

    row.prefill_computed = prometheus.prefill_computed(deltas)
    row.steps_per_min = _ratio(len(ok), run.elapsed_s / 60.0)
    row.requests_per_min = _ratio(len(records), run.elapsed_s / 60.0)
    row.compactions = sum(1 for r in ok if (r.pamer or {}).get("action") == "compressed")
    row.cache_break_tokens = sum(
        int(((r.pamer or {}).get("schedule") or {}).get("cache_break_tokens") or 0) for r in ok
    )
    row.preemptions = prometheus.total(deltas, "vllm:num_preemptions_total")

    echoed = [r for r in ok if r.available is not None]
    # a request refused as longer than the window shows the model nothing
    refused = [r for r in records if r.status == "beyond_window"]
    row.evidence_availability = _ratio(
        sum(r.available or 0 for r in echoed), sum(r.needed for r in echoed) + sum(r.needed for r in refused)
    )
    read = [r for r in ok if r.readable is not None]  # echoed, and read by the one rule
    row.needs = sum(r.needs for r in read) + sum(r.needs for r in refused)
    row.readable = _ratio(sum(r.readable or 0 for r in read), row.needs)
    row.observed = _ratio(sum(r.observed or 0 for r in read), row.needs)
    shared = [r for r in ok if r.chars_sent is not None]
    row.chars_share = _ratio(sum(r.chars_sent or 0 for r in shared), sum(r.chars_original for r in shared))

    details = [r for r in ok if r.cached_tokens is not None and r.usage_prompt_tokens]
    row.cache_hits = _ratio(
        sum(r.cached_tokens or 0 for r in details), sum(r.usage_prompt_tokens or 0 for r in details)
    )
    changed, row.recalls = recall_changes(ok)
    row.recall_changes = _ratio(changed, row.recalls)

    if baseline is not None and run.policy != BASELINE:
        reference = {(key_of(r), r.step): r for r in baseline if r.status == "ok"}
        pairs = [(r, reference[k]) for r in ok if (k := (key_of(r), r.step)) in reference]
        if pairs:
            row.agree_tool = mean(float(r.action_tool == b.action_tool) for r, b in pairs)
            row.agree_args = mean(jaccard(r.action_values, b.action_values) for r, b in pairs)
    return row


def summarize(records: Sequence[StepRecord], runs: Sequence[RunSummary]) -> list[PolicyRow]:
    """One row per policy, in run order (several runs of a policy merged)."""
    runs = merge_runs(runs)
    by_policy: dict[str, list[StepRecord]] = defaultdict(list)
    for r in records:
        by_policy[r.policy].append(r)
    baseline = by_policy.get(BASELINE) if any(run.policy == BASELINE for run in runs) else None
    return [policy_row(by_policy.get(run.policy, []), run, baseline) for run in runs]


def fmt(value: float | int | None, kind: str = "num") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "rate":
        return f"{value:.2f}"
    if kind == "pts":
        return f"{100 * value:+.1f} pt"
    if kind == "logp":
        return f"{value:.3f}"
    return f"{value:,.0f}"


COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "policy", "str"),
    ("trajectories", "trajectories", "num"),
    ("answered", "requests answered", "num"),
    ("beyond_window", "beyond window", "num"),
    ("tokens_per_trajectory", "tokens / trajectory", "num"),
    ("mean_peak_context", "mean peak context", "num"),
    ("prefill_computed", "prefill computed", "num"),
    ("peak_kv_usage", "peak KV", "pct"),
    ("steps_per_min", "answered / min", "rate"),
    ("requests_per_min", "requests / min", "rate"),
    ("preemptions", "preemptions", "num"),
    ("cache_hits", "cache hits", "pct"),
    ("compactions", "compactions", "num"),
    ("cache_break_tokens", "cache-break tokens", "num"),
    ("recall_changes", "recall changes", "pct"),
    ("evidence_availability", "evidence availability", "pct"),
    ("chars_share", "chars share", "pct"),
    ("over_recency", "over recency", "pts"),
    ("agree_tool", "same tool as none", "pct"),
    ("agree_args", "arg overlap with none", "rate"),
)


def markdown_table(rows: Sequence[PolicyRow], columns: Sequence[tuple[str, str, str]] = COLUMNS) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [
            str(getattr(row, field)) if kind == "str" else fmt(getattr(row, field), kind) for field, _, kind in columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replayed_frontier(records: Sequence[StepRecord], trajectories: Sequence[Mapping[str, Any]]) -> list[FrontierPoint]:
    """``recent_k``'s frontier (k = 1 .. the longest replay) on exactly the
    requests these records replayed: each trajectory up to its last step here."""
    steps: dict[str, int] = {}
    for r in records:
        steps[key_of(r)] = max(steps.get(key_of(r), 0), r.step + 1)
    if not steps:
        return []
    return recency_frontier(trajectories, range(1, max(steps.values()) + 1), steps)


def add_over_recency(rows: Sequence[PolicyRow], frontier: Sequence[FrontierPoint]) -> None:
    """Fill each row's leads over recency (one-sided, readable, observed) from
    the frontier of the same requests, at the row's chars share."""

    def lead(share: float | None, chars: float, reading: Reading) -> float | None:
        recency = recency_at(frontier, chars, reading) if share is not None else None
        return None if recency is None or share is None else share - recency

    for row in rows:
        if row.chars_share is None:
            continue
        row.over_recency = lead(row.evidence_availability, row.chars_share, "one_sided")
        row.readable_over_recency = lead(row.readable, row.chars_share, "readable")
        row.observed_over_recency = lead(row.observed, row.chars_share, "observed")


EVIDENCE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "policy", "str"),
    ("needs", "needs", "num"),
    ("beyond_window", "refused", "num"),
    ("readable", "readable", "pct"),
    ("observed", "observed", "pct"),
    ("chars_share", "chars share", "pct"),
    ("readable_over_recency", "readable over recency", "pts"),
    ("observed_over_recency", "observed over recency", "pts"),
    ("common", "common requests", "num"),
    ("readable_common", "readable, common", "pct"),
    ("observed_common", "observed, common", "pct"),
    ("prefill_common", "prefill computed, common", "num"),
    ("scored", "scored", "num"),
    ("action_logprob", "action log-prob", "logp"),
    ("logprob_lost", "lost vs full history", "logp"),
    ("logprob_lost_recency", "recency loses there", "logp"),
)
"""The evidence table: the one rule for every side (``evidence.needs``, ``readings``)."""


NOTES = """\
Tokens / trajectory: input + output of every request plus the plugin's internal
requests (eq. 45). Mean peak context: largest prompt sent per trajectory,
averaged (eq. 46). Evidence availability and chars share are pooled over
requests; a request refused as beyond the window keeps no evidence. Over
recency: evidence availability minus what recent_k keeps at the same chars
share on the same requests (recent_k itself reads about zero).
Agreement: on the steps `none` also answered. Cache hits: prompt tokens vLLM
served from its prefix cache. Recall changes: recalling requests that showed
another memory list than the session's previous recall. Policies run one
after another on one server: unless the prefix cache is emptied before each
(`--reset-prefix-cache`, as benchmarks/policies.py does), a later run may
reuse prefix-cache blocks of an earlier one (prefill computed).
"""


EVIDENCE_NOTES = """\
The table above reads evidence by a one-sided rule (evidence availability,
over recency): text a policy inserts counts, the record's copies of the
agent's own calls included, while the same calls in raw assistant messages
never count. The table below reads it by one rule for every policy and for
recency (replay/evidence.py): the needs of a request are the values its
recorded action uses that an observation after the prefix (a tool result, a
user turn) holds and the prefix does not; readable counts a need anywhere
after the prefix; observed only in observation text (raw tool and user
messages, and inserted text without the record's copies of the agent's calls
and words). Over recency: at the same chars share on the same requests.
Common: the requests every policy here answered; a refused request reads
nothing in the other columns. Prefill computed, common: the policy's prefill
less what its answered requests outside the common ones computed (its
summaries and other internal requests stay in it). Action log-prob (with ``--likelihood``): the
recorded next action's mean log-probability per token given what the policy
sent, teacher forced on the served model; lost vs full history: `none`'s minus
the policy's on the requests both scored; recency loses there: the same for
the recency rows (`recent_k`, `recent_<k>`, `sliding_window`) at the policy's
chars share.
"""


def evidence_table(rows: Sequence[PolicyRow]) -> str:
    return markdown_table(rows, EVIDENCE_COLUMNS)


KIND_TITLES = {"tau": "tau-bench", "swe": "mini-swe"}


def write_report(
    out_dir: str | Path,
    records: Sequence[StepRecord],
    runs: Sequence[RunSummary],
    *,
    records_name: str | None = "records.jsonl",
    title: str = "Replay",
    preface: str = "",
    trajectories: Sequence[Mapping[str, Any]] | None = None,
    paired: str | None = None,
) -> list[PolicyRow]:
    """``records_name`` (``.gz``: compressed) and runs.json (unless
    ``records_name`` is None: the caller keeps them), summary.json, report.md
    and the plots (context per turn, cost against evidence) in ``out_dir``.
    With trajectories of both kinds in single-kind runs, the report adds a
    table and plots per kind (their counters cannot be split otherwise). Given
    the replayed ``trajectories``, each row gets its evidence over recency's on
    the same requests, and a third plot shows it. ``paired``: a policy to set
    against every other one, request by request (``paired.py``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def rows_and_frontier(some_records, some_runs):
        rows = summarize(some_records, some_runs)
        frontier = replayed_frontier(some_records, trajectories) if trajectories is not None else []
        add_over_recency(rows, frontier)
        add_common(rows, some_records)
        add_spending(rows, some_records)
        add_likelihood(rows, some_records)
        return rows, frontier

    rows, frontier = rows_and_frontier(records, runs)
    if records_name is not None:
        write_records(out / records_name, list(records))
        write_runs(out / "runs.json", list(runs))
    (out / "summary.json").write_text(json.dumps(msgspec.to_builtins(rows), indent=2) + "\n")
    parts = [f"# {title}\n", preface, markdown_table(rows) + "\n", NOTES, EVIDENCE_NOTES, evidence_table(rows) + "\n"]
    if table := spending_table(rows):
        parts += [SPENDING_NOTES, table + "\n"]
    if table := latency_table(records):
        parts += [latency_notes(records), table + "\n"]
    if paired is not None and (table := paired_table(paired_rows(paired, rows, records))):
        parts.append(table + "\n")
    if table := compaction_table(runs):
        parts.append(table + "\n")
    kinds = sorted({run.kind for run in runs if run.kind})
    if len(kinds) > 1:
        for kind in kinds:
            kind_runs = [run for run in runs if run.kind == kind]
            kind_records = [r for r in records if r.kind == kind]
            name = KIND_TITLES.get(kind, kind)
            kind_rows, kind_frontier = rows_and_frontier(kind_records, kind_runs)
            parts.append(f"\n## {name}\n\n{markdown_table(kind_rows)}\n\n{evidence_table(kind_rows)}\n")
            if table := spending_table(kind_rows):
                parts.append(table + "\n")
            if paired is not None and (table := paired_table(paired_rows(paired, kind_rows, kind_records))):
                parts.append(table + "\n")
            parts += plot_all(out, kind_records, kind_rows, kind_frontier, f"_{kind}", name)
    else:
        parts += plot_all(out, records, rows, frontier)
    (out / "report.md").write_text("\n".join(part for part in parts if part))
    return rows
