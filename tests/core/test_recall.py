"""Recall's pure rules (``core/recall.py``): stable selection keeps the memories
shown unless a newcomer beats one by the margin. (The worker's search and its
merge with the API server's: tests/worker/test_memory.py.)"""

from __future__ import annotations

from vllm_pamer.core.recall import stable_selection


def test_stable_selection_keeps_previous_unless_beaten_by_margin():
    scores = {1: 0.50, 2: 0.48, 3: 0.47, 4: 0.49, 5: 0.60}
    assert stable_selection(scores, [], [5, 1, 4], 3, 0.05) == [1, 4, 5]
    # 4 now outscores 3 but only by 0.02: the previous set stays
    assert stable_selection(scores, [1, 2, 3], [1, 4, 2], 3, 0.05) == [1, 2, 3]
    # 5 beats the weakest (3, 0.47) by 0.13: it replaces it
    assert stable_selection(scores, [1, 2, 3], [5, 1, 4], 3, 0.05) == [1, 2, 5]
    # vanished members drop out, free places fill from the fresh list
    assert stable_selection({1: 0.5, 4: 0.1}, [1, 9], [4, 1], 3, 0.05) == [1, 4]
