"""The operation count of an extraction against a plain loop
(``cache_work_ratio``, printed by benchmarks/extract.py): the extractor skips
the whole KV blocks a prompt shares with its trajectory's previous one,
nothing across trajectories, and always computes the last token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_pamer.training.extract import cache_work_ratio

BLOCK = 16
CONFIG = SimpleNamespace(
    hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16
)


def test_a_prompt_extending_the_previous_one_is_served_by_whole_blocks():
    first = list(range(40))
    second = first + [99] * 8  # 40 shared tokens: 32 in whole blocks of 16
    ratio, served = cache_work_ratio([first, second], ["t", "t"], CONFIG, BLOCK)
    assert served == pytest.approx(32 / 88)
    assert ratio > 1


def test_nothing_is_shared_across_trajectories_or_by_an_identical_prompt_alone():
    same = list(range(32))
    assert cache_work_ratio([same, same], ["a", "b"], CONFIG, BLOCK) == (1.0, 0.0)
    ratio, served = cache_work_ratio([same, same], ["a", "a"], CONFIG, BLOCK)  # the last token is computed again
    assert served == pytest.approx(16 / 64) and ratio > 1


def test_a_computed_token_costs_more_than_an_average_one():
    """Each token the extractor computes attends over the cached context, so
    the operations' ratio stays below the tokens' ratio."""
    prompts = [list(range(4096)), list(range(4112))]
    ratio, served = cache_work_ratio(prompts, ["t", "t"], CONFIG, BLOCK)
    tokens_ratio = (4096 + 4112) / (4096 + 16)
    assert served == pytest.approx(4096 / 8208)
    assert 1 < ratio < tokens_ratio
