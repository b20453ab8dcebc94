"""The budget schedule's arithmetic (``core/policies/pamer/budget.py``), pure:
the budget, band and target from the window, the request and the KV cache;
when a request triggers a compaction; how many blocks it archives."""

from __future__ import annotations

from vllm_pamer.core.policies.pamer.budget import archive_count, budget_for, kv_scale, kv_share_tokens, trigger


class Settings:
    context_budget, budget_share, band_share, target_share = 0, 0.75, 0.25, 0.5
    kv_pressure, kv_low, kv_high, kv_min_scale, vote_under_kv_pressure = True, 0.5, 0.9, 0.5, False
    kv_share = 0.0


def test_budget_band_and_target_follow_window_request_and_kv():
    default = budget_for(Settings, 8192, None, None)
    assert (default.budget, default.band_low, default.target) == (6144, 4608, 3072)
    assert budget_for(Settings, 8192, 4000, None).budget == 4000  # the request's own budget
    assert budget_for(Settings, 8192, 100_000, None).budget == 8192  # never beyond the window
    assert kv_scale(Settings, 0.3) == 1.0 and kv_scale(Settings, 0.95) == 0.5 and kv_scale(Settings, 0.7) == 0.75
    scarce = budget_for(Settings, 8192, None, 0.95)
    assert (scarce.budget, scarce.base) == (3072, 6144)


def test_trigger_never_below_the_band_vote_inside_forced_at_the_top():
    budget = budget_for(Settings, 8192, None, None)
    assert trigger(budget, 4000, True, True) is None  # below the band, whatever the vote
    assert trigger(budget, 5000, True, False) is None and trigger(budget, 5000, True, None) is None
    assert trigger(budget, 5000, True, True) == "vote"
    assert trigger(budget, 6144, True, False) == "top_of_band"
    assert trigger(budget, 3000, False, False) == "window"
    scarce = budget_for(Settings, 8192, None, 0.95)
    assert trigger(scarce, 3500, True, False) == "kv_pressure"  # only because the KV cache is full


def test_under_kv_pressure_the_vote_waits_for_the_shrunk_budget():
    scarce = budget_for(Settings, 8192, None, 0.7)  # 4,608 tokens, the band from 3,456
    assert scarce.under_kv_pressure and not budget_for(Settings, 8192, None, 0.3).under_kv_pressure
    assert trigger(scarce, 4000, True, True) is None  # inside the shrunk band: the vote waits
    assert trigger(scarce, 4608, True, True) == "kv_pressure"

    class Voting(Settings):
        vote_under_kv_pressure = True

    assert trigger(budget_for(Voting, 8192, None, 0.7), 4000, True, True) == "vote"


def test_a_share_of_the_kv_cache_holds_the_budget_and_keeps_the_vote():
    class Sharing(Settings):
        kv_share = 0.8

    assert kv_share_tokens(Settings, 10_000, 4) is None  # off
    assert kv_share_tokens(Sharing, None, 4) is None  # capacity unknown
    assert kv_share_tokens(Sharing, 10_000, 4) == 2000 and kv_share_tokens(Sharing, 10_000, 0) == 8000
    held = budget_for(Sharing, 8192, None, None, 2000)
    assert (held.budget, held.base, held.band_low, held.target) == (2000, 6144, 1500, 1000)
    assert held.shared and held.under_kv_pressure and held.vote  # the share keeps it cached: the vote stays
    assert trigger(held, 1600, True, True) == "vote" and trigger(held, 2000, True, False) == "kv_pressure"
    scarce = budget_for(Sharing, 8192, None, 0.95, 2000)  # KV usage shrinks it to 3,072; the share to 2,000
    assert scarce.budget == 2000 and scarce.shared
    assert not budget_for(Sharing, 8192, None, None, 7000).shared  # a share above the budget changes nothing


def test_archive_count_reaches_the_target_and_keeps_the_recent_blocks():
    assert archive_count([100] * 10, 200, 700, keep_recent=2) == 5  # 200 + 5 x 100 <= 700
    assert archive_count([100] * 10, 200, 0, keep_recent=2) == 8  # never the last 2
    assert archive_count([100] * 3, 0, 10_000, keep_recent=2) == 1  # at least one when any may go
    assert archive_count([100] * 2, 0, 0, keep_recent=2) == 0


def test_without_a_window_or_a_budget_nothing_compacts():
    assert trigger(budget_for(Settings, 0, None, None), 10**9, True, True) is None
