"""The budget schedule's arithmetic, pure: when to compact, so that compaction
pays for itself on a prefix-cached server, and how much to archive.

Between two compactions what the server sends for a session only grows at its
end (append-only), so vLLM serves every earlier token from its prefix cache;
a compaction throws that cache away after the prefix, so it should come
rarely and remove much. The schedule has a context *budget* in tokens and a
*band* below it:

* below the band: never compact;
* inside the band: compact when the band's vote says compress
  (``band_vote``: by default nothing votes, so the band only waits for a large
  step; the heads' vote, a seeded coin or the metadata control can pick the
  moment instead);
* at the top of the band, or when the request would not fit the window:
  compact regardless;
* a compaction archives old blocks until what is sent falls to ``target``,
  far below the band, so the next one is many steps away.

The budget can follow the engine's KV pressure: with roomy KV it stays as
configured (compact late: cheap prefill); as the KV cache fills it shrinks
towards ``kv_min_scale`` of itself (compact earlier: a smaller footprint).
It can also be held to a share of the KV cache's capacity per active session
(``kv_share``), so that the sessions' contexts fit the cache together and each
stays in the prefix cache from one request to the next.
While KV usage has shrunk it the vote does not compact (unless ``vote_under_kv_pressure``):
the shrunk band lies where the sessions already are, and a compaction there
recomputes what the scarce cache could not keep, so only the shrunk budget's
top does (``benchmarks/HISTORY.md``, "The budget schedule under a KV budget
that binds").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from vllm_pamer.core.blocks import Block, Message
from vllm_pamer.core.policies.base import HeadVote, ScheduleReport, Trigger
from vllm_pamer.core.policies.pamer.config import BudgetConfig
from vllm_pamer.core.store import Memory
from vllm_pamer.core.view import ContextView, flatten

NO_BUDGET = 2**62
"""The budget when neither one nor the window is known."""


class Budget(msgspec.Struct, frozen=True):
    """The schedule's numbers for one request (all in tokens)."""

    budget: int
    """The effective budget (after KV pressure)."""
    base: int
    """The budget before KV pressure."""
    band_low: int
    """Where the band starts."""
    target: int
    """What a compaction brings the request down to."""
    vote: bool = True
    """Whether the heads' vote may compact inside the band."""
    shared: bool = False
    """The session's share of the KV cache (``kv_share``) bounds the budget:
    the sessions' contexts are sized to stay in the prefix cache together."""

    @property
    def under_kv_pressure(self) -> bool:
        """KV pressure has shrunk the budget."""
        return self.budget < self.base


def kv_scale(cfg: BudgetConfig, kv_usage: float | None) -> float:
    """The share of the budget that KV pressure leaves (1 when unknown or off)."""
    if not cfg.kv_pressure or kv_usage is None:
        return 1.0
    pressure = min(1.0, max(0.0, (kv_usage - cfg.kv_low) / (cfg.kv_high - cfg.kv_low)))
    return 1.0 - (1.0 - cfg.kv_min_scale) * pressure


def kv_share_tokens(cfg: BudgetConfig, kv_capacity: int | None, sessions: int) -> int | None:
    """A session's share of the KV cache: ``kv_share`` of its capacity (tokens)
    over the ``sessions`` sharing it; None when off or the capacity is unknown."""
    if not cfg.kv_share or not kv_capacity:
        return None
    return max(1, int(cfg.kv_share * kv_capacity / max(1, sessions)))


def budget_for(
    cfg: BudgetConfig, window: int, requested: int | None, kv_usage: float | None, share: int | None = None
) -> Budget:
    """The budget of a request: the request's own, else the configured one,
    else a share of the window; never beyond the window; shrunk by KV pressure
    and held to the session's ``share`` of the KV cache (``kv_share_tokens``)."""
    base = requested or cfg.context_budget or int(cfg.budget_share * window)
    if window:
        base = min(base, window)
    if base <= 0:  # no budget and no window known: nothing ever compacts
        base = NO_BUDGET
    budget = max(1, int(base * kv_scale(cfg, kv_usage)))
    shared = False
    if share is not None and share < budget:
        budget, shared = share, True
    # a band that KV usage moved down lies where the sessions already are; one held to
    # the session's share stays cached, so the vote may pick the moment there
    vote = budget == base or shared or cfg.vote_under_kv_pressure
    band_low, target = int(budget * (1 - cfg.band_share)), int(budget * cfg.target_share)
    return Budget(budget, base, band_low, target, vote, shared)


def band_vote(
    cfg: BudgetConfig, vote: HeadVote | None, session: str, step: int, control: bool | None = None
) -> bool | None:
    """Whether the band's vote says compress for a session's request at its
    ``step``-th block (None: no vote captured); ``control``: what the metadata
    control says of the request (``band_vote: control``)."""
    if cfg.band_vote == "heads":
        return vote.compress_vote if vote is not None else None
    if cfg.band_vote == "never":
        return False
    if cfg.band_vote == "control":
        return control
    # a stable coin: the same session and step give the same answer in every process and run
    digest = hashlib.blake2b(f"{cfg.random_vote_seed}:{session}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < cfg.random_vote_rate


def trigger(budget: Budget, sent_tokens: int, fits_window: bool, compress_vote: bool | None) -> Trigger | None:
    """Why a request of ``sent_tokens`` must compact now (None: it need not)."""
    if not fits_window:
        return "window"
    if sent_tokens >= budget.budget:
        return "top_of_band" if sent_tokens >= budget.base else "kv_pressure"
    if sent_tokens >= budget.band_low and compress_vote and budget.vote:
        return "vote"
    return None


def archive_count(block_tokens: Sequence[int], fixed_tokens: int, target: int, keep_recent: int) -> int:
    """How many of the oldest blocks to archive so that ``fixed_tokens`` (the
    prefix and the memory text after the compaction) plus the blocks left is
    at most ``target``; the ``keep_recent`` newest blocks are never archived,
    and at least one block is when any may be."""
    archivable = max(0, len(block_tokens) - max(0, keep_recent))
    remaining = fixed_tokens + sum(block_tokens)
    count = 0
    while count < archivable and (remaining > target or count == 0):
        remaining -= block_tokens[count]
        count += 1
    return count


CHARS_PER_TOKEN = 3.5
"""Characters a token, where a budget in tokens must become one in characters
before anything is counted: choosing the memories to show after a restart runs
on every request until a compaction, where a template count (``core/tokens.py``)
of each candidate costs more than the choice is worth; a compaction uses the conversation's own ratio."""


ANSWER_SHARE = 0.25
"""The most of the window a request's own answer length reserves in the
window check; a longer one (beyond what the window could ever give) does not
force a compaction on every request."""


def answer_room(answer_tokens: int | None, window: int) -> int:
    """Tokens a request's answer (``answer_tokens`` asked for) needs beside its prompt."""
    return max(0, min(answer_tokens or 0, int(ANSWER_SHARE * window)))


class Offset(msgspec.Struct, frozen=True):
    """sent tokens = the request's tokens as received - ``tokens``, while the
    covered blocks and the memories shown are these."""

    covered: int
    shown: tuple[int, ...]
    tokens: int


class Plan(msgspec.Struct, frozen=True):
    """The blocks a compaction now would archive (the ``count`` oldest live ones)
    and the room it keeps for the new memory's record."""

    count: int
    prefix_tokens: int
    block_tokens: list[int]
    record_tokens: int

    @property
    def archived_tokens(self) -> int:
        return sum(self.block_tokens[: self.count])


class Choice(msgspec.Struct, frozen=True):
    """What the schedule decided for one request (``decide``), for the action."""

    view: ContextView
    budget: Budget
    searchable: list[Memory]
    """The session's memories of the current embedder (the others still cover their blocks)."""
    shown: list[Memory]
    """The memories the request shows: those the last compaction chose."""
    sent: list[Message]
    """The request as it goes out without a compaction: P + the memories + the live blocks."""
    report: ScheduleReport
    trigger: Trigger | None = None
    """Why the request compacts (None: it does not)."""
    plan: Plan | None = None
    """The blocks the compaction archives."""


def chars_per_token(archived: Sequence[Block], plan: Plan) -> float:
    """Characters a token in the blocks ``plan`` archives: the conversation's own ratio."""
    chars = sum(len(str(m.get("content") or "")) for m in flatten(archived))
    return max(2.0, chars / max(1, plan.archived_tokens))
