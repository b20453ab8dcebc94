"""One policy against each other policy of a run on the same requests
(``benchmarks/policies.py --paired POLICY``; the vote against its ablations,
issue 32): the differences on the requests both answered, each with a 95%
interval from a bootstrap over trajectories (a trajectory's requests are not
independent of each other)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from vllm_pamer.replay.records import PolicyRow, StepRecord, key_of
from vllm_pamer.replay.retrieval import bootstrap_ci


class PairedRow(msgspec.Struct):
    """``policy`` minus ``other``, request by request."""

    policy: str
    other: str
    trajectories: int
    """Trajectories those requests come from (the bootstrap's units)."""
    requests: int
    """Requests both answered with an evidence reading."""
    one_sided: int
    """Requests only one of the two answered (left out of every column)."""
    needs: int
    """The needs of those requests (the one rule, ``evidence.needs``)."""
    readable: float | None
    """Readable needs, the policy's less the other's, over the needs (a share)."""
    readable_ci: tuple[float, float] | None
    observed: float | None
    observed_ci: tuple[float, float] | None
    scored: int
    """Requests both scored by the likelihood pass."""
    logprob: float | None
    """Mean difference of the next action's mean log-probability per token."""
    logprob_ci: tuple[float, float] | None
    prefill_ratio: float | None
    """The policy's prefill computed over the other's, whole runs (internal requests included)."""


def _difference(
    values: np.ndarray, groups: np.ndarray, weights: np.ndarray | None
) -> tuple[float | None, tuple[float, float] | None]:
    total = float(values.size if weights is None else weights.sum())
    if not total:
        return None, None
    return float(values.sum()) / total, bootstrap_ci(values, groups, weights=weights)


def paired_rows(policy: str, rows: Sequence[PolicyRow], records: Sequence[StepRecord]) -> list[PairedRow]:
    """``policy`` against every other row's policy."""
    by_policy: dict[str, dict[tuple[str, int], StepRecord]] = {}
    for r in records:
        if r.status == "ok":
            by_policy.setdefault(r.policy, {})[(key_of(r), r.step)] = r
    prefill = {row.policy: row.prefill_computed for row in rows}
    mine = by_policy.get(policy, {})
    out = []
    for row in rows:
        if row.policy == policy:
            continue
        theirs = by_policy.get(row.policy, {})
        both = [k for k in mine if k in theirs and mine[k].readable is not None]
        both = sorted(k for k in both if theirs[k].readable is not None)
        one_sided = len(set(mine) ^ set(theirs))
        groups = np.asarray([k[0] for k in both], dtype=object)
        needs = np.asarray([mine[k].needs for k in both], dtype=np.float64)
        readable = np.asarray([(mine[k].readable or 0) - (theirs[k].readable or 0) for k in both], dtype=np.float64)
        observed = np.asarray([(mine[k].observed or 0) - (theirs[k].observed or 0) for k in both], dtype=np.float64)
        scored = [k for k in mine if k in theirs and mine[k].action_logprob is not None]
        scored = sorted(k for k in scored if theirs[k].action_logprob is not None)
        logprob = np.asarray(
            [(mine[k].action_logprob or 0.0) - (theirs[k].action_logprob or 0.0) for k in scored], dtype=np.float64
        )
        mine_prefill, their_prefill = prefill.get(policy), prefill.get(row.policy)
        r_diff, r_ci = _difference(readable, groups, needs)
        o_diff, o_ci = _difference(observed, groups, needs)
        l_diff, l_ci = _difference(logprob, np.asarray([k[0] for k in scored], dtype=object), None)
        out.append(
            PairedRow(
                policy=policy,
                other=row.policy,
                trajectories=len({k[0] for k in both}),
                requests=len(both),
                one_sided=one_sided,
                needs=int(needs.sum()),
                readable=r_diff,
                readable_ci=r_ci,
                observed=o_diff,
                observed_ci=o_ci,
                scored=len(scored),
                logprob=l_diff,
                logprob_ci=l_ci,
                prefill_ratio=mine_prefill / their_prefill if mine_prefill and their_prefill else None,
            )
        )
    return out


PAIRED_NOTES = """\
Paired: {policy} minus each other policy on the requests both answered
(readable, observed: the one rule's needs, in points of those requests'
needs; log-prob: the next action's mean log-probability per token, on the
requests both scored), with 95% intervals from 2,000 bootstrap draws of
whole trajectories (percentile intervals: on a handful of trajectories they
are rough and too narrow rather than too wide); one-sided: requests only one
of the two answered, left out; prefill: {policy}'s computed prefill over the
other's, whole runs (its summaries included; a request refused computes none).
"""


def _points(value: float | None, ci: tuple[float, float] | None) -> str:
    if value is None or ci is None:
        return "-"
    return f"{100 * value:+.1f} pt ({100 * ci[0]:+.1f} to {100 * ci[1]:+.1f})"


def _logp(value: float | None, ci: tuple[float, float] | None) -> str:
    if value is None or ci is None:
        return "-"
    return f"{value:+.3f} ({ci[0]:+.3f} to {ci[1]:+.3f})"


def paired_table(paired: Sequence[PairedRow]) -> str:
    if not paired:
        return ""
    lines = [
        "| policy | against | trajectories | requests | one-sided | needs | readable | observed | scored "
        "| action log-prob | prefill |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in paired:
        ratio = f"{p.prefill_ratio:.2f}x" if p.prefill_ratio is not None else "-"
        lines.append(
            f"| {p.policy} | {p.other} | {p.trajectories} | {p.requests} | {p.one_sided} | {p.needs} "
            f"| {_points(p.readable, p.readable_ci)} "
            f"| {_points(p.observed, p.observed_ci)} | {p.scored} | {_logp(p.logprob, p.logprob_ci)} | {ratio} |"
        )
    return PAIRED_NOTES.format(policy=paired[0].policy) + "\n" + "\n".join(lines)
