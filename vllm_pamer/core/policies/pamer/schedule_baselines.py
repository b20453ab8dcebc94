"""Baselines on PaMER's budget schedule: the same compactions (the band, the
vote inside it, the forced top, the large rare steps that keep vLLM's prefix
cache), with less in place of the archived blocks, so a memory policy can be
judged against what the schedule alone buys (issue 31):

* ``truncate``: nothing; the archived blocks are dropped (stored raw, so
  nothing is lost), no engine request;
* ``record_only``: the verbatim record of the archived steps (``record.py``)
  without a summary; the newest record covers every archived step, so it
  alone is shown: no engine request. With ``turns_share`` the newest archived
  blocks follow it, their outputs masked (as PaMER's memory with it);
* ``observation_masking``: the archived blocks themselves with their tool
  outputs replaced by a placeholder and the agent's own turns kept
  (``discard_tool``'s rule, applied only at compactions so it keeps the
  prefix cache); the oldest masked steps leave once the masked history
  passes ``memory_share`` of the budget;
* ``excerpt_masking``: observation masking whose placeholders are each
  followed by the lines of that output the record would keep (``record.py``'s
  choice, within ``record_share`` of the budget): the agent's turns stay as
  it wrote them, and an old output's values stay where it read them.

They take PaMER's budget options (``BudgetConfig``) and refuse those they do
not read (``options_read``; every option of ``BudgetConfig`` is in exactly one
of the groups below, a test checks it). They need no heads: without a vote
they compact at the band's top.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from vllm_pamer.core.policies.base import PolicyConfig, register_policy
from vllm_pamer.core.policies.pamer.config import BudgetConfig
from vllm_pamer.core.policies.pamer.memory import MemoryKind
from vllm_pamer.core.policies.pamer.policy import Pamer

SCHEDULE_OPTIONS = frozenset(
    {
        "retained_blocks",
        "context_budget",
        "budget_share",
        "band_share",
        "target_share",
        "kv_pressure",
        "kv_low",
        "kv_high",
        "kv_min_scale",
        "vote_under_kv_pressure",
        "band_vote",
        "random_vote_rate",
        "random_vote_seed",
        "control_trigger",
        "kv_share",
        "kv_share_idle_s",
        "write_ahead",
    }
)
"""What the budget schedule itself reads (``budget.py``, ``budget_schedule.py``'s decision)."""
SHOWN_OPTIONS = frozenset({"memory_share"})
"""What a memory shown beside others reads: the room of the memories shown."""
RECORD_OPTIONS = frozenset({"record_share"})
"""What a memory with a record reads."""
TURNS_OPTIONS = frozenset({"turns_share"})
"""What a memory whose record may be followed by archived turns reads."""
SIMILARITY_OPTIONS = frozenset({"top_k", "embed_timeout_s", "embed_attempts", "query_source"})
"""What memories chosen by similarity to the captured state read."""
SUMMARY_OPTIONS = frozenset(
    {
        "summary_source_chars",
        "summary_max_tokens",
        "summary_timeout_s",
        "summary_attempts",
        "summary_layout",
        "kv_pressure_summary",
        "kv_pressure_summary_layout",
        "summary_after",
    }
)
"""What only a memory with a summary (PaMER's) reads."""


class _OnTheBudgetSchedule(Pamer):
    requires_heads = False
    options_read: ClassVar[frozenset[str]] = SCHEDULE_OPTIONS
    """The options of ``BudgetConfig`` this baseline reads; any other is refused,
    not ignored (a new budget option is refused until it is classified above)."""

    @classmethod
    def config_classes(cls) -> tuple[type[PolicyConfig], ...]:
        return (BudgetConfig,)

    @classmethod
    def make_config(cls, options: dict[str, Any]) -> PolicyConfig:
        unread = sorted(
            name for name in options if name in BudgetConfig.__struct_fields__ and name not in cls.options_read
        )
        if unread:
            raise ValueError(f"{', '.join(unread)}: not an option of {cls.name} (it runs the budget schedule)")
        return msgspec.convert(options, BudgetConfig)


@register_policy
class Truncate(_OnTheBudgetSchedule):
    name = "truncate"
    memory_kind: ClassVar[MemoryKind] = "none"
    options_read = SCHEDULE_OPTIONS


@register_policy
class RecordOnly(_OnTheBudgetSchedule):
    name = "record_only"
    memory_kind: ClassVar[MemoryKind] = "record"
    options_read = SCHEDULE_OPTIONS | RECORD_OPTIONS | TURNS_OPTIONS


@register_policy
class ObservationMasking(_OnTheBudgetSchedule):
    name = "observation_masking"
    memory_kind: ClassVar[MemoryKind] = "masked"
    options_read = SCHEDULE_OPTIONS | SHOWN_OPTIONS


@register_policy
class ExcerptMasking(_OnTheBudgetSchedule):
    name = "excerpt_masking"
    memory_kind: ClassVar[MemoryKind] = "excerpts"
    options_read = SCHEDULE_OPTIONS | SHOWN_OPTIONS | RECORD_OPTIONS
