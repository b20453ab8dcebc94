"""Did every compaction a replay started end? Read from the server's own
store events (``GET /pamer/sessions/{id}``), after a policy's run: each
``compression_started`` must be followed by one of ``COMPACTION_ENDS``
(``core/fallback.py``) before the session's next start. A memory written
ahead (``write_ahead``) whose session sent no request after it, and that the
server still holds (the route's ``memory_in_flight``), is in flight when the
replay ends: counted apart, not as a fault. Only the schedules that log
``compression_started`` (PaMER's) are counted; an end logged by another of
the session's requests while a memory is written ahead (a store read that
failed) ends it here too. Summaries written after their compaction
(``summary_after``) are counted apart: one per compaction that committed its
record and left its summary to the background, and their ends (added, or
not added: a failure, the memory changed, the server stopping); what neither
counts was still being written when the events were read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

from vllm_pamer.core.fallback import COMPACTION_ENDS
from vllm_pamer.replay.records import RunSummary

COUNTS = (
    "started",
    "compressed",
    "abandoned",
    "failed",
    "in_flight",
    "unended",
    "summaries_after",
    "summaries_added",
    "summaries_not_added",
)
"""What ``tally`` counts: starts; their ends by kind (a failure: any rule of
``COMPACTION_ENDS``); starts written ahead still open at the session's end;
starts that never ended (a fault); summaries left to the background by a
compaction (``summary_after``), and those added and not added."""
EVENTS_READ = 1_000_000
"""Events asked for per session: all the store keeps (``StoreLimits.session_events``)."""


def tally(events: Sequence[Mapping[str, Any]], held: bool = True) -> dict[str, int]:
    """The ``COUNTS`` of one session's events, oldest first; ``held``: the
    server still holds a memory written ahead for it (else one left open is unended)."""
    counts = dict.fromkeys(COUNTS, 0)
    open_ahead: bool | None = None  # None: no compaction open
    for event in events:
        kind = event.get("kind")
        if kind == "compression_started":
            if open_ahead is not None:  # a second start before the first ended
                counts["unended"] += 1
            counts["started"] += 1
            open_ahead = bool((event.get("detail") or {}).get("ahead"))
        elif kind in ("summary_added", "summary_not_added"):
            counts[kind.replace("summary", "summaries", 1)] += 1
        elif kind in COMPACTION_ENDS and open_ahead is not None:
            if kind == "compressed" and (event.get("detail") or {}).get("summary") == "after":
                counts["summaries_after"] += 1
            ending = {"compressed": "compressed", "compression_abandoned": "abandoned"}.get(str(kind), "failed")
            counts[ending] += 1
            open_ahead = None
    if open_ahead is not None:
        counts["in_flight" if open_ahead and held else "unended"] += 1
    return counts


async def read_compactions(client: httpx.AsyncClient, url: str, sessions: Iterable[str]) -> dict[str, int] | None:
    """``tally`` summed over ``sessions`` (a session the server does not know
    had no event); None when they could not all be read (the session route
    off, the store or the network failing): the run's records stand without it."""
    total = dict.fromkeys(COUNTS, 0)
    for session in sorted(set(sessions)):
        try:
            response = await client.get(
                f"{url.rstrip('/')}/pamer/sessions/{session}", params={"events": EVENTS_READ}, timeout=30
            )
            if response.status_code == 404 and "no session" in response.text:
                continue
            response.raise_for_status()
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            print(f"compactions not read ({session}: {exc}); the run is kept without them")
            return None
        for name, value in tally(body.get("events") or [], body.get("memory_in_flight") is not None).items():
            total[name] += value
    return total


def compaction_table(runs: Iterable[RunSummary]) -> str:
    """Per policy, the ``COUNTS`` summed over its runs that read them
    (``RunSummary.compactions``); empty when no run did."""
    totals: dict[str, dict[str, int]] = {}
    for run in runs:
        if run.compactions is None:
            continue
        row = totals.setdefault(run.policy, dict.fromkeys(COUNTS, 0))
        for name in COUNTS:
            row[name] += run.compactions.get(name, 0)
    if not any(row["started"] for row in totals.values()):
        return ""
    lines = [
        "\nCompactions begun and ended, from the server's store events of the run's sessions "
        "(`replay/compactions.py`): every start must end (committed, abandoned or a failure "
        "rule) before the next; *in flight*: a memory written ahead with no request after it; "
        "*summaries after*: compactions that left their summary to the background (`summary_after`), "
        "then those added to their memory and not added (the rest were still being written).\n",
        "| policy | " + " | ".join(COUNTS) + " |",
        "|---|" + "---|" * len(COUNTS),
    ]
    lines += [f"| {policy} | " + " | ".join(str(row[n]) for n in COUNTS) + " |" for policy, row in totals.items()]
    return "\n".join(lines)
