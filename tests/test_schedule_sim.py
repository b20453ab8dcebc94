"""benchmarks/schedule_sim.py, the engine-free model used to choose schedule
settings: its stand-in engine must keep the whole engine contract, or every
compaction falls back and the model reports a policy that never compacts."""

from __future__ import annotations

import argparse

from benchmarks.policies import policy_options
from benchmarks.schedule_sim import ModelEngine, simulate
from vllm_pamer.core.engine import EngineServices
from vllm_pamer.trajectories import load_trajectories


def test_the_model_engine_keeps_the_engine_contract_and_pamer_compacts(tokenizer_dir):
    from transformers import AutoTokenizer

    from vllm_pamer.core.render import render_tools_as_text
    from vllm_pamer.core.tokens import TokenCounter

    counter = TokenCounter(AutoTokenizer.from_pretrained(str(tokenizer_dir)), render_tools_as_text)
    contract = {name for name in dir(EngineServices) if not name.startswith("_")} | {"embedder_name", "max_model_len"}
    engine = ModelEngine(counter, 8192)
    assert {name for name in contract if not hasattr(engine, name)} == set()
    args = argparse.Namespace(max_steps=30, vote_p=0.8, seed=0, window=8192, block=128, kv_usage=None)
    trajectories = load_trajectories(kind="swe")[:1]
    options = {**policy_options(96)["pamer_tight"], "context_budget": 3000}
    out = simulate("pamer_tight", options, trajectories, args, counter)
    assert out["fallbacks"] == 0 and out["compactions"] > 0 and out["refused"] == 0
