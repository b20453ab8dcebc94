"""PaMER's options (``--pamer-policy-options``): one config type per schedule.

``schedule`` picks the type: ``budget`` (the default, ``BudgetConfig``) or
``paper`` (``PaperConfig``); each refuses the other's options, so an option
that would be silently ignored is an error instead. What both schedules read
is declared once, in ``PamerOptions``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from vllm_pamer.core.policies.summary_writer import SUMMARY_LAYOUTS, SummaryConfig


class PamerOptions(SummaryConfig, frozen=True):
    """What both schedules read: the summaries (``SummaryConfig``), the
    memories' embeddings and the recall query."""

    summary_layout: str = "conversation"
    """As in ``SummaryConfig``; PaMER's default resends the conversation the
    engine saw last, so the summary's prefill comes from the prefix cache
    (``benchmarks/RESULTS.md`` compares the two layouts)."""
    top_k: int = 3
    """Memories recalled (paper) or shown (budget) per request."""
    embed_timeout_s: float = 300.0
    """Time limit of one embedding attempt. An embedding is a short request,
    but on a loaded engine it waits for KV room behind the requests running
    (``benchmarks/HISTORY.md``, "The budget schedule under a KV budget that
    binds: a stall")."""
    embed_attempts: int = 8
    """Attempts before an embedding counts as failed (errors only: a timeout is not retried, ``core/retry.py``)."""
    query_source: str = "captured"
    """``captured`` (the deferred retrieval of the in-engine design; beyond the
    paper): the state the engine captured at the end of the session's previous
    prompt, which costs no request (benchmarks/retrieval.py compares the two);
    falls back to ``text`` when no state was captured or the memories come from
    another embedder. ``text``: the paper's recall query, task + R embedded by
    an internal request (the budget schedule then orders older memories by age)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.query_source not in ("text", "captured"):
            raise ValueError(f"query_source must be 'text' or 'captured', not {self.query_source!r}")
        if self.top_k < 1:
            raise ValueError("top_k must be >= 1")


class BudgetConfig(PamerOptions, frozen=True):
    """The budget schedule (``budget_schedule.py``): compactions that keep
    vLLM's prefix cache."""

    schedule: Literal["budget"] = "budget"
    """When to compact: never below the band, on the heads' vote inside it,
    always at its top; what is sent grows append-only between compactions and
    the memory text changes only at them, so vLLM's prefix cache serves it.
    ``paper`` is the other schedule (``PaperConfig``)."""
    context_budget: int = 0
    """Tokens a session's request may reach before it must compact; 0:
    ``budget_share`` of the served window. A request may set its own with the
    ``X-Pamer-Context-Budget`` header (or ``pamer_context_budget``)."""
    budget_share: float = 0.9
    """The default budget as a share of the served window: late (compactions
    are rare, prefill cheap), with room left for the answer."""
    band_share: float = 0.1
    """The band is the top ``band_share`` of the budget; there the vote decides."""
    target_share: float = 0.4
    """A compaction archives old blocks until the request is at most this share of the budget."""
    kv_pressure: bool = True
    """Shrink the budget as the engine's KV cache fills."""
    kv_low: float = 0.5
    """KV-cache usage (0-1) up to which the budget stays whole."""
    kv_high: float = 0.9
    """KV-cache usage at which the budget has shrunk to ``kv_min_scale``."""
    kv_min_scale: float = 0.5
    """The smallest share of the budget KV pressure leaves."""
    band_vote: Literal["heads", "never", "random", "control"] = "never"
    """What decides inside the band: nothing (``never``: a compaction only at
    the band's top or the window); the heads' vote (``heads``); a coin seeded
    by the session and its step, firing at ``random_vote_rate``; or the
    metadata control (``control``: length, progress and the last tool,
    ``control_vote.py``). ``never`` by default: on the server the heads' vote
    read no more than a coin at its rate and less than no vote, at more
    prefill (``benchmarks/RESULTS.md``, "The vote's ablation"); the heads'
    state still chooses the memories recalled."""
    control_trigger: str = ""
    """``band_vote: control``: the fitted control's file (``vllm-pamer
    train-control``); empty: the shipped one, fitted on the tuning split."""
    random_vote_rate: float = 0.5
    """``band_vote: random``: the chance a request inside the band compacts
    (set it to the heads' own rate on the same requests)."""
    random_vote_seed: int = 0
    """``band_vote: random``: the coin's seed."""
    vote_under_kv_pressure: bool = False
    """Let the heads' vote compact inside the band while KV pressure has shrunk
    the budget. Off: then only the shrunk budget's top (or the window)
    compacts, since the shrunk band lies where the sessions already are."""
    kv_share: float = 0.0
    """Hold each session's budget to this share of the engine's KV cache
    (tokens) divided by the sessions with a request in the last
    ``kv_share_idle_s``, so their contexts fit the cache together and each is
    served from the prefix cache between its compactions; its summaries then
    resend the conversation, which stays cached. 0: off (beyond the paper;
    ``benchmarks/RESULTS.md``, "A budget from the KV cache's capacity")."""
    kv_share_idle_s: float = 60.0
    """A session with no request for this long no longer shares the KV cache."""
    write_ahead: bool = False
    """When a compaction is called for and the request still fits the window,
    write the memory in the background and send the request as it is; the
    session's first request after the memory is ready compacts with it
    (``ahead.py``). Only a request the window cannot hold waits for a memory.
    Off: the request that calls for the compaction waits for its memory."""
    summary_after: bool = True
    """A compaction commits its memory with the verbatim record alone (no
    summary request), so the request that compacts does not wait for a
    summary; the summary of the same blocks is written in the background and
    put before the record in the stored memory (``summary_after.py``). The
    newest memory is then shown by its record, older ones by their
    summaries, so the memory text still changes only at compactions; a
    memory is recalled by the embedding it was committed with (the state
    captured at the session's previous prompt, or its record embedded), not
    by its summary's. Off: the compacting request waits for its summary.
    ``write_ahead`` writes the whole memory ahead instead (``summary_after``
    then does nothing)."""
    kv_pressure_summary: bool = True
    """Write a summary while KV pressure or ``kv_share`` has shrunk the budget.
    Off: the memory is the verbatim record alone, embedded by the state the
    engine captured at the end of the session's previous prompt, so a
    compaction adds no request to a scarce engine (``benchmarks/RESULTS.md``,
    "A budget from the KV cache's capacity")."""
    kv_pressure_summary_layout: str = "text"
    """The summary layout while KV pressure (not ``kv_share``) has shrunk the
    budget. ``text`` prefills only the archived steps: a scarce cache seldom
    still holds the conversation that ``conversation`` resends."""
    record_share: float = 0.25
    """The verbatim record of the steps a compaction archives (``record.py``)
    has at most this share of the budget; a compaction archives enough raw
    blocks to make room for it (chosen on the tuning split:
    ``benchmarks/RESULTS.md``, "The record's lines")."""
    memory_share: float = 0.3
    """The memories a request shows take at most this share of the budget."""
    turns_share: float = 0.0
    """After a memory with a record, show the newest archived blocks as the
    agent wrote them, their tool outputs masked, within this share of the
    budget (the record's lines stand for those outputs; ``memory.py``,
    ``turns_text``); a compaction keeps room for them and the record, so
    ``record_share + turns_share`` stays under ``target_share``. 0: none."""

    @property
    def summaries_after(self) -> bool:
        """Whether a compaction leaves its summary to the background: ``summary_after`` without ``write_ahead``."""
        return self.summary_after and not self.write_ahead

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_pressure_summary_layout not in SUMMARY_LAYOUTS:
            raise ValueError(
                f"kv_pressure_summary_layout must be 'text' or 'conversation', not {self.kv_pressure_summary_layout!r}"
            )
        if self.context_budget < 0:
            raise ValueError("context_budget must be >= 0 (0: a share of the window)")
        if not 0 < self.budget_share <= 1 or not 0 <= self.band_share < 1 or not 0 < self.target_share < 1:
            raise ValueError("budget_share must be in (0, 1], band_share in [0, 1), target_share in (0, 1)")
        if self.target_share >= 1 - self.band_share:
            raise ValueError("target_share must lie below the band (target_share < 1 - band_share)")
        if self.control_trigger and self.band_vote != "control":
            raise ValueError(f"control_trigger is read only with band_vote 'control', not {self.band_vote!r}")
        if not 0 <= self.kv_low < self.kv_high <= 1 or not 0 < self.kv_min_scale <= 1:
            raise ValueError("need 0 <= kv_low < kv_high <= 1 and 0 < kv_min_scale <= 1")
        if not 0 <= self.kv_share <= 1:
            raise ValueError("kv_share must be in [0, 1] (0: off)")
        if self.kv_share_idle_s <= 0:
            raise ValueError("kv_share_idle_s must be > 0")
        if not 0 < self.record_share < 1 or not 0 < self.memory_share < 1:
            raise ValueError("record_share and memory_share must be in (0, 1)")
        if not 0 <= self.turns_share < 1:
            raise ValueError("turns_share must be in [0, 1) (0: no archived turns shown)")
        if self.turns_share and self.record_share + self.turns_share >= self.target_share:
            raise ValueError(
                f"record_share + turns_share ({self.record_share} + {self.turns_share}) must stay under "
                f"target_share ({self.target_share}): a compaction keeps room for both, the prefix and the "
                "summary below its target"
            )


class PaperConfig(PamerOptions, frozen=True):
    """The paper's schedule (``paper_schedule.py``, PaMER paper Algorithm 1);
    defaults are the paper's Table 14."""

    schedule: Literal["paper"] = "paper"
    """A compression whenever tokens(O) reaches ``min_candidate_tokens`` and the
    vote says so, and a recall on every request."""
    min_candidate_tokens: int = 1024
    """Compression gate: tokens(O) must reach this."""
    query_chars: int = 30_000
    """Recall query: task + R, limited to its final characters."""
    stable_recall: bool = True
    """Keep the memories recalled at the session's previous request unless a
    new one beats the weakest of them by ``recall_margin`` (cosine): the
    inserted text then stays identical between requests and vLLM's prefix
    cache keeps the prompt up to it (beyond the paper; its Prop. C.2 margin)."""
    recall_margin: float = 0.05
    """Cosine margin a new memory must win by to replace a recalled one."""
    window_guard: bool = True
    """Compress without waiting for the vote when the request as sent does not
    fit the served model's window (beyond the paper, whose probe reads up to
    35,000 tokens beside the agent). Here the vote comes from the served
    model's own prefill, which a request longer than the window never gets:
    without the guard the server refuses it, and every later request of the
    session, since the history only grows. The compression is the same
    transaction: if it fails the request goes through unchanged."""
    summarize_ahead: bool = False
    """Overlap mode: when request t's vote says compress (known at its prefill),
    start summarizing the blocks that will be old at request t+1 while the agent
    runs its tools; request t+1 commits that summary if it covers its old
    blocks. Off: the paper's synchronous mode (summary written inside t+1)."""


PamerConfig = BudgetConfig | PaperConfig
"""PaMER's config under either schedule."""
SCHEDULES: dict[str, type[PamerOptions]] = {"budget": BudgetConfig, "paper": PaperConfig}


def schedule_config(
    options: Mapping[str, Any], schedules: Mapping[str, type[PamerOptions]] = SCHEDULES
) -> PamerOptions:
    """The config of the schedule ``options`` names (``schedule``, default: the
    first of ``schedules``). An option of another schedule is refused by name."""
    schedule = options.get("schedule", next(iter(schedules)))
    cls = schedules.get(schedule) if isinstance(schedule, str) else None
    if cls is None:
        raise ValueError(f"schedule must be {' or '.join(map(repr, schedules))}, not {schedule!r}")
    others = [
        name
        for name in options
        if name not in cls.__struct_fields__ and any(name in c.__struct_fields__ for c in SCHEDULES.values())
    ]
    if others:
        raise ValueError(f"{', '.join(others)}: not an option of schedule {schedule!r} (see PaMER's options)")
    return msgspec.convert(dict(options), cls)
