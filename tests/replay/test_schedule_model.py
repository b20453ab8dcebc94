"""The engine-free model used to choose schedule settings
(``replay/schedule_model.py``): its stand-in engine must keep the whole engine
contract, or every compaction falls back and the model reports a policy that
never compacts."""

from __future__ import annotations

import pytest

from vllm_pamer.core.engine import EngineServices
from vllm_pamer.replay.schedule_model import ModelEngine, ModelSettings, simulate
from vllm_pamer.replay.variants import policy_options
from vllm_pamer.trajectories import load_trajectories


@pytest.fixture(scope="module")
def counter(tokenizer_dir):
    from transformers import AutoTokenizer

    from vllm_pamer.core.render import render_tools_as_text
    from vllm_pamer.core.tokens import TokenCounter

    return TokenCounter(AutoTokenizer.from_pretrained(str(tokenizer_dir)), render_tools_as_text)


def test_the_model_engine_keeps_the_engine_contract_and_pamer_compacts(counter):
    contract = {name for name in dir(EngineServices) if not name.startswith("_")} | {"embedder_name", "max_model_len"}
    engine = ModelEngine(counter, 8192)
    assert {name for name in contract if not hasattr(engine, name)} == set()
    trajectories = load_trajectories(kind="swe")[:1]
    options = {**policy_options(96)["pamer_tight"], "context_budget": 3000}
    out = simulate("pamer_tight", options, trajectories, ModelSettings(), counter)
    assert out["fallbacks"] == 0 and out["compactions"] > 0 and out["refused"] == 0


def test_sessions_side_by_side_share_the_modelled_kv_cache(counter):
    trajectories = load_trajectories(kind="swe")[:2]
    options = {**policy_options(96)["pamer"], "kv_share": 0.8}
    runs = {}
    for capacity in (None, 8000):  # unknown: the default budget; 8,000: 3,200 tokens a session
        args = ModelSettings(max_steps=12, kv_capacity=capacity, side_by_side=2)
        runs[capacity] = simulate("pamer", options, trajectories, args, counter)
    assert runs[8000]["fallbacks"] == 0 and runs[8000]["compactions"] > runs[None]["compactions"]


def test_a_budget_every_request_sets_reaches_each_policy_with_one(counter):
    """``context_budget`` is the header every replayed request sets: PaMER,
    configured with the default budget, compacts by it; recent_k ignores it."""
    trajectories = load_trajectories(kind="swe")[:1]
    options = policy_options(96)["pamer"]
    runs = {
        budget: simulate("pamer", options, trajectories, ModelSettings(max_steps=12, context_budget=budget), counter)
        for budget in (None, 3000)
    }
    assert runs[3000]["fallbacks"] == 0 and runs[3000]["compactions"] > runs[None]["compactions"]
    recency = [
        simulate("recent_k", {}, trajectories, ModelSettings(max_steps=12, context_budget=b), counter)
        for b in (None, 3000)
    ]
    assert recency[0] == recency[1]
