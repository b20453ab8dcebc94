"""Hindsight labels for the budget schedule's vote (``vllm-pamer annotate
--annotator hindsight``): at each decision point, whether compacting *now*
loses no more of what the following actions use than compacting at the next
decision point. Offline and for training only: the labels read the
trajectory's later steps, which the server never sees, and no memory text is
built from them.

A compaction at decision point s archives what the budget schedule's would
(``core/policies/pamer/budget.py``, ``archive_count``): the oldest blocks,
until the prefix, the record's room and the blocks left fit the target
(``target_share`` of ``budget``), the ``n_recent`` newest kept raw. What it
loses for an action a at or after s: the values of a that only the archived
blocks hold (the reference rule's old-only evidence, ``annotate.old_only``,
with O = the archived blocks). With H = ``horizon`` and t the point:

* lost(t)   = the values the actions t .. t+H-1 lose to a compaction at t;
* lost(t+1) = the values the actions t+1 .. t+H-1 lose to one at t+1 (the
  action at t, sent before it, saw the whole history);
* compression_t = 1 iff |lost(t)| <= |lost(t+1)| (a tie compacts now: the
  smaller request comes sooner); at a trajectory's last point, iff lost(t)
  is empty. ``compression_values``: lost(t).

Recall and the gate (tokens(O_t) >= ``min_old_tokens``) are the reference
rule's, so both label sets cover the same points.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import msgspec

from vllm_pamer.core.policies.pamer.budget import archive_count
from vllm_pamer.core.policies.pamer.config import BudgetConfig
from vllm_pamer.replay.variants import TIGHT_BUDGET
from vllm_pamer.training.annotate import (
    AnnotatorSettings,
    CountTokens,
    DecisionContext,
    DecisionPoint,
    old_only,
    read_trajectory,
    reference_points,
    register_annotator,
)


@register_annotator("hindsight")
class HindsightAnnotator:
    """Compression labels by hindsight over the budget schedule's compaction;
    recall as the reference rule's."""

    name = "hindsight"
    definition: ClassVar[str] = (
        "compression = 1 where compacting now, as the budget schedule would (the oldest blocks down to "
        "its target, the newest kept), loses no more of the values the next actions use than compacting "
        "at the next decision point (training/hindsight.py); recall as the reference rule's"
    )

    def __init__(
        self,
        settings: AnnotatorSettings,
        count_tokens: CountTokens,
        budget: int = TIGHT_BUDGET,
        target_share: float = BudgetConfig().target_share,
        record_share: float = BudgetConfig().record_share,
    ) -> None:
        self.settings = settings
        self.count_tokens = count_tokens
        self.target = int(target_share * budget)
        """Tokens a compaction brings the request down to."""
        self.record_tokens = int(record_share * budget)
        """The record's room beside the prefix."""
        self.token_cache: dict[str, int] = {}

    def annotate(self, trajectory: Mapping[str, Any]) -> list[DecisionPoint]:
        s = self.settings
        facts = read_trajectory(trajectory, self.count_tokens, s, self.token_cache)
        reference = reference_points(trajectory, facts, s)
        messages, contexts, values = facts.messages, facts.contexts, facts.values
        fixed = self.count_tokens(list(facts.conversation.prefix)) + self.record_tokens
        starts, tokens = facts.block_starts, facts.block_tokens

        def lost(j: int, actions: Sequence[DecisionContext]) -> set[str]:
            """What a compaction at point j loses for ``actions``."""
            ctx = contexts[j]
            count = archive_count(tokens[: ctx.n_old_blocks + ctx.n_recent_blocks], fixed, self.target, s.n_recent)
            if count == 0:
                return set()
            archived = msgspec.structs.replace(ctx, old_end=starts[count] if count < len(starts) else len(messages))
            return {
                v
                for a in actions
                for v in values[a.message_index]
                if old_only(facts.where(v), archived, a.message_index, facts.observed)
            }

        out = []
        for j, point in enumerate(reference):
            if point.compression is None:
                out.append(msgspec.structs.replace(point, annotator=self.name))
                continue
            actions = contexts[j : j + max(1, s.horizon)]
            now = lost(j, actions)
            later = lost(j + 1, actions[1:]) if len(actions) > 1 else None
            compression = int(len(now) <= len(later)) if later is not None else int(not now)
            out.append(
                msgspec.structs.replace(
                    point, compression=compression, compression_values=sorted(now), annotator=self.name
                )
            )
        return out
