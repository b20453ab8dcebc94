"""PaMER's options (``core/policies/pamer/config.py``) are checked when the policy is made."""

from __future__ import annotations

import pytest

from vllm_pamer.core.policies import create_policy


def test_settings_are_checked():
    with pytest.raises(ValueError, match="target_share"):
        create_policy("pamer", {"target_share": 0.95})  # inside the band
    with pytest.raises(ValueError, match="schedule"):
        create_policy("pamer", {"schedule": "eager"})


def test_query_source_is_checked():
    with pytest.raises(ValueError, match="query_source"):
        create_policy("pamer", {"schedule": "paper", "query_source": "state"})


def test_the_schedule_picks_the_config_and_each_refuses_the_others_options():
    from vllm_pamer.core.policies.pamer import BudgetConfig, PamerPlusConfig, PaperConfig

    assert type(create_policy("pamer").config) is BudgetConfig
    assert type(create_policy("pamer", {"schedule": "paper"}).config) is PaperConfig
    assert type(create_policy("pamer_plus").config) is PamerPlusConfig
    budget_only, paper_only = set(BudgetConfig.__struct_fields__), set(PaperConfig.__struct_fields__)
    shared = budget_only & paper_only
    assert {"retained_blocks", "summary_max_tokens", "top_k", "query_source", "schedule"} <= shared
    for option in sorted(budget_only - shared):  # context_budget, kv_share, record_share, ...
        with pytest.raises(ValueError, match=rf"{option}: not an option of schedule 'paper'"):
            create_policy("pamer", {"schedule": "paper", option: 1})
        with pytest.raises(ValueError, match=option):
            create_policy("pamer_plus", {option: 1})
    for option in sorted(paper_only - shared):  # min_candidate_tokens, summarize_ahead, window_guard, ...
        with pytest.raises(ValueError, match=rf"{option}: not an option of schedule 'budget'"):
            create_policy("pamer", {option: 1})
    with pytest.raises(ValueError, match="unknown field"):
        create_policy("pamer", {"no_such_option": 1})  # an option of neither: msgspec's own refusal


def test_the_record_and_the_turns_must_leave_room_below_the_target():
    """A compaction keeps room for both below its target: past it, every
    compaction would keep one raw block (refused, with the numbers)."""
    with pytest.raises(ValueError, match=r"record_share \+ turns_share \(0.25 \+ 0.3\)"):
        create_policy("record_only", {"turns_share": 0.3})
    with pytest.raises(ValueError, match="target_share"):
        create_policy("pamer", {"record_share": 0.2, "turns_share": 0.2, "target_share": 0.4})
    create_policy("pamer", {"record_share": 0.2, "turns_share": 0.1})
    create_policy("pamer", {"record_share": 0.5, "target_share": 0.4})  # without turns: as before
