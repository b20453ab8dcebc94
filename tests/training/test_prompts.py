"""The probe's token ids cut to its limit (``training/prompts.py``); no engine."""

from __future__ import annotations

import pytest

from vllm_pamer.training.prompts import ChatPrompter, token_limit, truncate_ids


def test_truncate_ids_keeps_head_and_most_recent():
    ids = list(range(100))
    assert truncate_ids(ids, 100, 10) == (ids, False)
    kept, cut = truncate_ids(ids, 30, 10, cut_stride=0)
    assert cut and kept == list(range(10)) + list(range(80, 100))
    kept, _ = truncate_ids(ids, 30, 2048, cut_stride=0)  # head scaled to half the limit
    assert kept == list(range(15)) + list(range(85, 100))
    assert token_limit(8192) == 8191 and token_limit(131072) == 35000


def test_the_cut_moves_in_steps_so_growing_prompts_extend_each_other():
    limit, head = 30, 10  # recent room 20: the cut moves 10 tokens at a time
    cuts = [truncate_ids(list(range(n)), limit, head)[0] for n in range(31, 71)]
    for n, kept in zip(range(31, 71), cuts):
        assert kept[:head] == list(range(head)) and kept[-1] == n - 1  # the head and the newest token
        assert limit - 10 < len(kept) <= limit
    moves = [i for i in range(1, len(cuts)) if cuts[i][: len(cuts[i - 1])] != cuts[i - 1]]
    assert moves == [10, 20, 30]  # 40 prompts, the cut moved 3 times: the others extend the one before
    assert truncate_ids(list(range(40)), limit, head)[0] == list(range(10)) + list(range(20, 40))
    assert truncate_ids(list(range(41)), limit, head)[0] == list(range(10)) + list(range(30, 41))
    with pytest.raises(ValueError, match="share"):
        ChatPrompter(None, limit, head, cut_stride=1.5)
