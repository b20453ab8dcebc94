"""A replay's figures by the one evidence rule (``evidence.needs``,
``readings``) and its next-action likelihood, added to the report's rows:
each policy on the requests every policy answered, and what a policy loses
against the full history (``none``) beside what recency loses at the same
chars share."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from statistics import mean

from vllm_pamer.replay.records import PolicyRow, StepRecord, key_of

FULL_HISTORY = "none"
"""The policy whose requests are the full history."""


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def add_common(rows: Sequence[PolicyRow], records: Sequence[StepRecord]) -> None:
    """Each row's readings on the requests every policy of ``rows`` answered
    with an echo (so a refusal elsewhere weighs on no policy)."""
    answered: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for r in records:
        if r.status == "ok" and r.readable is not None:
            answered[r.policy].add((key_of(r), r.step))
    sets = [answered.get(row.policy, set()) for row in rows]
    common = set.intersection(*sets) if sets else set()
    for row in rows:
        mine = [r for r in records if r.policy == row.policy and (key_of(r), r.step) in common]
        wanted = sum(r.needs for r in mine)
        row.common = len(common)
        row.readable_common = _share(sum(r.readable or 0 for r in mine), wanted)
        row.observed_common = _share(sum(r.observed or 0 for r in mine), wanted)
        row.prefill_common = _prefill_common(row, [r for r in records if r.policy == row.policy], common)


def _prefill_common(row: PolicyRow, records: Sequence[StepRecord], common: set[tuple[str, int]]) -> float | None:
    """The row's computed prefill less what its answered requests outside ``common`` computed."""
    outside = [r for r in records if r.status == "ok" and (key_of(r), r.step) not in common]
    if row.prefill_computed is None or any(r.usage_prompt_tokens is None or r.cached_tokens is None for r in outside):
        return None
    return row.prefill_computed - sum((r.usage_prompt_tokens or 0) - (r.cached_tokens or 0) for r in outside)


RECENCY_POLICIES = ("recent_k", "sliding_window")
"""Recency's rows: these policies, and variants named ``recent_<k>``."""


def is_recency(policy: str) -> bool:
    return policy in RECENCY_POLICIES or policy.startswith("recent_")


def add_likelihood(rows: Sequence[PolicyRow], records: Sequence[StepRecord]) -> None:
    """Each row's mean action log-probability, what it loses against ``none``
    (the full history) on the requests both scored, and what recency loses at
    the same chars share: linear between the recency rows and ``none`` (recency
    with every block, which loses nothing); None outside them."""
    scored: dict[str, dict[tuple[str, int], float]] = defaultdict(dict)
    for r in records:
        if r.action_logprob is not None:
            scored[r.policy][(key_of(r), r.step)] = r.action_logprob
    full = scored.get(FULL_HISTORY, {})
    for row in rows:
        mine = scored.get(row.policy, {})
        row.action_logprob = mean(mine.values()) if mine else None
        row.scored = len(mine)
        both = [k for k in mine if k in full]
        row.logprob_lost = mean(full[k] - mine[k] for k in both) if both else None
    curve = sorted(
        (row.chars_share, row.logprob_lost)
        for row in rows
        if (is_recency(row.policy) or row.policy == FULL_HISTORY)
        and row.chars_share is not None
        and row.logprob_lost is not None
    )
    for row in rows:
        if row.chars_share is not None and len(curve) > 1:
            row.logprob_lost_recency = _interpolate(curve, row.chars_share)


def _interpolate(curve: Sequence[tuple[float, float]], x: float) -> float | None:
    """``curve`` (sorted by x) read at ``x``, linear between its points; None outside them."""
    if x < curve[0][0] or x > curve[-1][0]:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1]
