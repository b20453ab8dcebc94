"""The shipped heads held in bf16 (how the worker holds them on CUDA,
``worker/capture.py``) decide as the fp32 heads do, on real states: the
embedded model's captured final-norm states at real agent decision points
(shipped tau-bench and mini-swe-agent trajectories), read from a real vLLM
engine through the capture channel and rounded to bf16 as a GPU engine
serves them."""

from __future__ import annotations

import pytest
import torch

from vllm_pamer.core.heads import load_heads
from vllm_pamer.default_model import ensure_default_model, shipped_heads
from vllm_pamer.kernels import FiveHeadVote
from vllm_pamer.offline_engine import CaptureEngine
from vllm_pamer.training.prompts import ChatPrompter
from vllm_pamer.trajectories import agent_requests, load_trajectories

pytestmark = pytest.mark.engine

MAX_TOKENS = 6000  # decision points whose prompt fits; the engine's window is 8192


def _decision_points(tokenizer) -> list[list[int]]:
    """Token ids of real agent requests, as the server feeds them to the engine."""
    prompter = ChatPrompter(tokenizer, MAX_TOKENS)
    prompts = []
    for kind, count, steps in (("tau", 4, 12), ("swe", 3, 10)):
        for trajectory in load_trajectories(None, kind)[:count]:
            for _, history in list(agent_requests(trajectory["messages"]))[:steps]:
                ids = prompter.template_ids(history)
                if len(ids) <= MAX_TOKENS:
                    prompts.append(ids)
    return prompts


def test_bf16_heads_decide_as_fp32_heads_on_real_states():
    from transformers import AutoTokenizer

    heads_path = shipped_heads()
    if heads_path is None:
        pytest.skip("no shipped heads")
    model_dir = ensure_default_model(quiet=True)
    prompts = _decision_points(AutoTokenizer.from_pretrained(model_dir))
    assert len(prompts) >= 50
    with CaptureEngine(model_dir, max_model_len=8192, max_num_seqs=8) as engine:
        states = torch.from_numpy(engine.states(prompts)).bfloat16()

    heads = load_heads(heads_path)
    weights = [torch.from_numpy(getattr(heads, n)) for n in ("w1", "b1", "w2", "b2", "thresholds")]
    full = FiveHeadVote(*weights, heads.min_votes, "cpu")
    half = FiveHeadVote(*weights, heads.min_votes, "cpu", bf16_heads=True)
    logits32, votes32, decision32 = full(states)
    logits16, votes16, decision16 = half(states)
    gap = (logits32 - logits16).abs().max().item()
    margin = (logits32 - torch.from_numpy(heads.thresholds)).abs().min().item()
    print(
        f"{len(prompts)} states: decisions differ {int((decision32 != decision16).sum())}, votes differ "
        f"{int((votes32 != votes16).sum())}, max logit gap {gap:.2e}, smallest margin to a threshold {margin:.2e}"
    )
    assert decision32.any() and not decision32.all(), "the states should take both decisions"
    assert torch.equal(decision32, decision16)
