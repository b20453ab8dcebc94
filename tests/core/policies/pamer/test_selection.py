"""PaMER+ step-selection validation: the paper's invalid-selection and
valid-empty-selection rules (Table 15)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_pamer.core.policies.pamer.selection import StepSelection, validate_selection
from vllm_pamer.core.store import Memory, StepDetail


def memory(memory_id: int, blocks: list[str], steps: list[int] | None = None) -> Memory:
    steps = list(range(len(blocks))) if steps is None else steps
    details = tuple(StepDetail(step=s, block_id=b) for s, b in zip(steps, blocks))
    return Memory(memory_id, "s", f"summary {memory_id}", np.ones(4, np.float32), "e", tuple(blocks), details, 0.0)


MEMORIES = [memory(1, ["a", "b", "c"]), memory(2, ["d", "e"])]


def test_valid_selection_returns_only_the_named_steps_in_order():
    result = validate_selection(StepSelection([2, 1], ["2.1", "1.0"]), MEMORIES)
    assert result.kind == "valid"
    assert [(s.memory_id, s.detail.block_id) for s in result.steps] == [(1, "a"), (2, "e")]
    assert result.cache_key == ((1, 2), ("1.0", "2.1"))
    # the same selection in another order shares the cache entry
    assert validate_selection(StepSelection([1, 2], ["1.0", "2.1"]), MEMORIES).cache_key == result.cache_key


def test_empty_selection_is_valid_and_injects_nothing():
    result = validate_selection(StepSelection([1], []), MEMORIES)
    assert result.kind == "empty" and result.steps == ()


@pytest.mark.parametrize(
    "selection, reason",
    [
        (StepSelection([1], ["2.0"]), "belongs to no selected summary"),  # foreign: summary 2 not selected
        (StepSelection([1], ["1.7"]), "does not exist"),  # missing step
        (StepSelection([1], ["1.0", "1.0"]), "named twice"),
        (StepSelection([9], ["9.0"]), "not a memory of this session"),
        (StepSelection([1, 1], ["1.0"]), "repeated"),
        (StepSelection([1], ["step-one"]), "is not '<memory id>.<step>'"),
    ],
)
def test_invalid_selections_are_rejected(selection, reason):
    result = validate_selection(selection, MEMORIES)
    assert result.kind == "invalid" and reason in result.reason and result.steps == ()


@pytest.mark.parametrize(
    "memories, reason",
    [
        ([memory(1, ["a", "b", "c"], steps=[0, 2, 3])], "gap"),
        ([memory(1, ["a", "b", "c"], steps=[0, 1, 1])], "overlapping steps"),
        ([memory(1, ["a", "b"]), memory(2, ["b", "c"])], "overlap on a block"),
    ],
)
def test_broken_partitions_are_rejected(memories, reason):
    ids = [m.id for m in memories]
    result = validate_selection(StepSelection(ids, [f"{ids[0]}.0"]), memories)
    assert result.kind == "invalid" and reason in result.reason
