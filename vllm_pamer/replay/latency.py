"""How long a replayed request took, per policy (issue 33: no compaction the
agent waits for): end-to-end latency percentiles of the answered requests,
and apart the requests that compacted, which wait for their memory today."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_pamer.replay.records import StepRecord

LATENCY_NOTES = """\
Latency: seconds from sending a request to its whole answer, on the answered
requests (on a loaded CPU they wait for each other too: compare policies
within one run). Compacting: the requests whose rewrite compacted, which wait
for their memory before the engine sees them, unless it was written ahead
(``write_ahead``); the others: every other answered request. Waited: the
compacting requests that waited for their memory, the seconds they waited
in all and the longest wait (as the schedule reports them; blank where a
policy reports none): a summary is seconds to minutes, a record alone
(``record_only``, ``summary_after``) a fraction of a second.
"""
TTFT_NOTE = """Time to first token (a streamed replay, ``--stream``): seconds from sending a
request to its answer's first token, what an agent that streams waits for.
"""


def latency_notes(records: Sequence[StepRecord]) -> str:
    """The notes above the latency table: the time to first token's only where the replay streamed."""
    return LATENCY_NOTES + (TTFT_NOTE if any(r.ttft_s is not None for r in records) else "")


def _percentiles(values: Sequence[float], digits: int = 1) -> str:
    if not values:
        return "- | - | -"
    p50, p95 = np.percentile(values, [50, 95])
    return f"{p50:.{digits}f} | {p95:.{digits}f} | {max(values):.{digits}f}"


def waited_s(record: StepRecord) -> float | None:
    """The seconds a compacting request waited for its memory (0.0: it did
    not wait, written ahead; NaN: it waited, its policy reports no time; None: no compaction)."""
    pamer = record.pamer or {}
    if pamer.get("action") != "compressed":
        return None
    schedule = pamer.get("schedule") or {}
    if schedule.get("memory_ahead"):
        return 0.0
    seconds = schedule.get("memory_seconds")
    return float(seconds) if seconds is not None else float("nan")


def latency_table(records: Sequence[StepRecord]) -> str:
    """One row per policy: p50 / p95 / max latency of its answered requests,
    of those that compacted and of the others, and of their first tokens
    where the replay streamed; empty without records."""
    policies = list(dict.fromkeys(r.policy for r in records))
    if not policies:
        return ""
    streamed = any(r.ttft_s is not None for r in records)
    ttft = " ttft p50 s | ttft p95 s | ttft max s |" if streamed else ""
    lines = [
        "| policy | answered | p50 s | p95 s | max s | compacting | compacting p50 s | compacting p95 s "
        f"| compacting max s | others p95 s | waited | waited s | waited max s |{ttft}",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if streamed else ""),
    ]
    for policy in policies:
        ok = [r for r in records if r.policy == policy and r.status == "ok"]
        compacting = [r.latency_s for r in ok if (r.pamer or {}).get("action") == "compressed"]
        others = [r.latency_s for r in ok if (r.pamer or {}).get("action") != "compressed"]
        other_p95 = f"{np.percentile(others, 95):.1f}" if others else "-"
        waits = [w for w in map(waited_s, ok) if w is not None and w != 0.0]
        known = [w for w in waits if not np.isnan(w)]
        total, longest = (f"{sum(known):.1f}", f"{max(known):.1f}") if known else ("-", "-")
        lines.append(
            f"| {policy} | {len(ok)} | {_percentiles([r.latency_s for r in ok])} | {len(compacting)} | "
            f"{_percentiles(compacting)} | {other_p95} | {len(waits)} | {total} | {longest} |"
            + (f" {_percentiles([r.ttft_s for r in ok if r.ttft_s is not None], 2)} |" if streamed else "")
        )
    return "\n".join(lines)
