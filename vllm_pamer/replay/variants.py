"""Named policy variants to replay side by side: each a registered policy with
options over its defaults, served under its own name (the value of ``vllm-pamer
serve --pamer-options-by-policy``), so one server runs every variant and a
request picks one by name. ``vllm-pamer replay --serve`` and the benchmarks
(``benchmarks/policies.py``, ``kv_budget.py``) serve these; a name that is a
registered policy (``pamer``, ``sam``, ...) sets that policy's own options.
"""

from __future__ import annotations

from typing import Any

TIGHT_BUDGET = 4096
"""The tight operating point's context budget: half the embedded model's window."""


def policy_options(summary_tokens: int) -> dict[str, dict[str, Any]]:
    """Every variant's options by name; ``summary_tokens``: the length of the
    summaries, cues and recalls they ask the engine for."""
    n = summary_tokens
    paper = {"policy": "pamer", "schedule": "paper", "summary_max_tokens": n, "summary_layout": "text"}
    return {
        "pamer": {"summary_max_tokens": n},  # the budget schedule at its defaults
        # the budget schedule with the paper's summary request (the old steps as one text)
        "pamer_text": {"policy": "pamer", "summary_max_tokens": n, "summary_layout": "text"},
        # the budget schedule with its memories written ahead of need (issue 33)
        "pamer_ahead": {"policy": "pamer", "summary_max_tokens": n, "write_ahead": True},
        # the summary written after its compaction, which commits the record at once (the default
        # since 2026-12-06, issue 33), and the synchronous schedule before it: the compacting
        # request waits for its summary
        "pamer_after": {"policy": "pamer", "summary_max_tokens": n, "summary_after": True},
        "pamer_inline": {"policy": "pamer", "summary_max_tokens": n, "summary_after": False},
        # written ahead from a band twice as wide: the memory starts a tenth of the budget earlier,
        # so it is ready about where the synchronous schedule compacts (its requests grow while it is
        # written); the wider band also lets the vote fire from 0.8 of the budget and asks each
        # compaction to archive at least a fifth of it (budget_schedule.py, "large steps only")
        "pamer_ahead_wide": {"policy": "pamer", "summary_max_tokens": n, "write_ahead": True, "band_share": 0.2},
        # the vote and its ablations: the heads' vote (the default until the ablation of
        # 2026-12-06), no vote (the band's top: the default since; the name of the earlier runs),
        # a seeded coin at the heads' rate: the shipped heads voted compress at 35 of the 40
        # requests inside the band on the tight mini-swe run (benchmarks/RESULTS.md, "The vote's ablation")
        "pamer_vote": {"policy": "pamer", "summary_max_tokens": n, "band_vote": "heads"},
        "pamer_band_top": {"policy": "pamer", "summary_max_tokens": n, "band_vote": "never"},
        "pamer_random_vote": {
            "policy": "pamer",
            "summary_max_tokens": n,
            "band_vote": "random",
            "random_vote_rate": 0.875,
        },
        # and the metadata control as the trigger (ablation c: length, progress, last tool),
        # fitted on the tuning split (vllm_pamer/data/control_trigger.json)
        "pamer_control_vote": {"policy": "pamer", "summary_max_tokens": n, "band_vote": "control"},
        # the tight operating point: a context budget of half the window
        "pamer_tight": {"policy": "pamer", "summary_max_tokens": n, "context_budget": TIGHT_BUDGET},
        # the budget schedule as before 8ee507b under KV pressure: the vote compacts inside the
        # shrunk band and the summary resends the conversation
        "pamer_kv_vote": {
            "policy": "pamer",
            "summary_max_tokens": n,
            "vote_under_kv_pressure": True,
            "kv_pressure_summary_layout": "conversation",
        },
        # the budget held to each session's share of the KV cache (kv_share), so that the sessions'
        # contexts stay in the prefix cache together under a KV budget that binds
        "pamer_kv_share": {"policy": "pamer", "summary_max_tokens": n, "kv_share": 0.8},
        # and no engine request at a compaction under KV pressure: the memory is the record alone
        "pamer_kv_record": {"policy": "pamer", "summary_max_tokens": n, "kv_share": 0.8, "kv_pressure_summary": False},
        "pamer_paper": paper,  # the paper's schedule (Algorithm 1), what `pamer` was before the budget schedule
        "pamer_plus": {"summary_max_tokens": n, "recall_max_tokens": n},
        "periodic_summary": {"summary_max_tokens": n},
        "rolling_summary": {"summary_max_tokens": n},
        "sam": {"cue_max_tokens": n, "recall_max_tokens": n},
        # the record followed by the newest archived turns, outputs masked (issue 31), in the room
        # the best of the tuning split's engine-free grid at the tight budget gave them
        "record_turns_lean": {"policy": "record_only", "record_share": 0.2, "turns_share": 0.1},
        "pamer_turns": {"policy": "pamer", "summary_max_tokens": n, "turns_share": 0.1},
        # recency at more character shares: the curve a policy's next-action likelihood is read against
        "recent_5": {"policy": "recent_k", "k": 5},
        "recent_10": {"policy": "recent_k", "k": 10},
        "recent_20": {"policy": "recent_k", "k": 20},
        # variants of the paper schedule measured in earlier runs
        "pamer_unstable": {**paper, "stable_recall": False},
        "pamer_conversation": {**paper, "summary_layout": "conversation"},
        "pamer_text_query": {**paper, "query_source": "text"},
    }
