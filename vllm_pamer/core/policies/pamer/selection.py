"""Exact-step selection validation (PaMER+, paper Appendix C.3, Algorithm 2).

A selector names summary ids and the smallest set of raw steps it needs. A
summary id locates a memory; it does not authorize restoring every step that
memory covers: only the named steps of the named memories may come back
(paper eq. 40). A step is named ``"<memory id>.<step>"``, the step being the
block's position in that memory's ``step_details``.

``validate_selection`` returns a valid empty selection (inject nothing; not a
failure), the authorized steps, or a rejection with its reason (gaps or
overlaps in the memories' partitions, missing, duplicated, malformed or
unauthorized steps). A rejection never authorizes removing anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

from vllm_pamer.core.store import Memory, StepDetail


class StepSelection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The selector's answer (JSON, constrained by this schema)."""

    summary_ids: list[int]
    raw_steps_needed: list[str]


class SelectedStep(msgspec.Struct, frozen=True):
    memory_id: int
    detail: StepDetail


class SelectionResult(msgspec.Struct, frozen=True):
    kind: Literal["empty", "valid", "invalid"]
    steps: tuple[SelectedStep, ...] = ()
    reason: str = ""

    @property
    def cache_key(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Sorted (summary ids, step ids): the reuse key of a recall result."""
        return (
            tuple(sorted({s.memory_id for s in self.steps})),
            tuple(sorted(f"{s.memory_id}.{s.detail.step}" for s in self.steps)),
        )


def _invalid(reason: str) -> SelectionResult:
    return SelectionResult("invalid", reason=reason)


def _partition_problem(memory: Memory) -> str | None:
    steps = [d.step for d in memory.step_details]
    if len(set(steps)) != len(steps):
        return f"memory {memory.id}: overlapping steps {sorted(steps)}"
    if sorted(steps) != list(range(len(steps))):
        return f"memory {memory.id}: gap in steps {sorted(steps)}"
    if [d.block_id for d in memory.step_details] != list(memory.covered_block_ids):
        return f"memory {memory.id}: step details do not match its covered blocks"
    return None


def validate_selection(selection: StepSelection, memories: Mapping[int, Memory] | Sequence[Memory]) -> SelectionResult:
    by_id = memories if isinstance(memories, Mapping) else {m.id: m for m in memories}
    if not selection.raw_steps_needed:
        return SelectionResult("empty")
    if len(set(selection.summary_ids)) != len(selection.summary_ids):
        return _invalid("a summary id is repeated")
    chosen = []
    for memory_id in selection.summary_ids:
        memory = by_id.get(memory_id)
        if memory is None:
            return _invalid(f"summary id {memory_id} is not a memory of this session")
        problem = _partition_problem(memory)
        if problem:
            return _invalid(problem)
        chosen.append(memory)
    seen_blocks: dict[str, int] = {}
    for memory in chosen:
        for block_id in memory.covered_block_ids:
            if block_id in seen_blocks:
                return _invalid(f"memories {seen_blocks[block_id]} and {memory.id} overlap on a block")
            seen_blocks[block_id] = memory.id

    steps: list[SelectedStep] = []
    named: set[tuple[int, int]] = set()
    for name in selection.raw_steps_needed:
        try:
            memory_part, step_part = name.split(".")
            key = (int(memory_part), int(step_part))
        except ValueError:
            return _invalid(f"step {name!r} is not '<memory id>.<step>'")
        if key in named:
            return _invalid(f"step {name!r} is named twice")
        named.add(key)
        if key[0] not in selection.summary_ids:
            return _invalid(f"step {name!r} belongs to no selected summary")
        details = {d.step: d for d in by_id[key[0]].step_details}
        if key[1] not in details:
            return _invalid(f"step {name!r} does not exist")
        steps.append(SelectedStep(key[0], details[key[1]]))
    steps.sort(key=lambda s: (s.memory_id, s.detail.step))
    return SelectionResult("valid", tuple(steps))
