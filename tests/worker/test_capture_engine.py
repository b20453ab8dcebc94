"""Capture on a real vLLM engine (offline ``LLM``, driven by
``vllm_pamer.offline_engine.CaptureEngine``) with tiny random models: the
captured row is the final-norm state of the last prompt token (compared to HF
transformers), exactly once per request (the engine refuses a state lost or
captured twice), also when the prompt is split over several prefill chunks,
asks for prompt logprobs, is preempted and resumed, or shares its step with
speculative draft rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.tiny_models import ARCHITECTURES, build_tiny_model, hf_last_token_states
from vllm_pamer.core.heads import load_heads, random_heads, save_heads
from vllm_pamer.kernels import five_head_vote_reference
from vllm_pamer.model_config import model_fingerprint
from vllm_pamer.offline_engine import CaptureEngine

pytestmark = pytest.mark.engine

CHUNK = 64  # prefill token budget per step: prompts above it are chunked


def start_tiny_engine(kind: str, root, tokenizer_dir, **engine_args):
    """A capture engine on a tiny random ``kind`` model whose workers vote
    with random heads (``engine_args``: more of ``LLM``'s)."""
    model_dir = build_tiny_model(kind, root / "model", tokenizer_dir)
    heads_path = root / "heads.safetensors"
    save_heads(random_heads(model_fingerprint(model_dir, f"tiny-{kind}"), seed=1), heads_path)
    engine = CaptureEngine(
        model_dir,
        heads=heads_path,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,
        gpu_memory_utilization=0.15,
        enable_chunked_prefill=True,
        **engine_args,
    )
    return engine, model_dir, load_heads(heads_path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("tiny-llama")
    engine, model_dir, heads = start_tiny_engine("llama", root, tokenizer_dir, disable_log_stats=False)
    with engine:
        yield engine, model_dir, heads


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 1, size=n).tolist() for n in lengths]


def _generate(engine, prompts, **params):
    """One record per prompt, in order, from one generate call: requests
    decode (4 tokens unless told) after the captured prefill, and a state
    lost or captured twice fails (no second attempt)."""
    return engine.records(prompts, attempts=1, **{"max_tokens": 4, **params})


def test_one_capture_per_request_matching_hf(tiny_llama):
    engine, model_dir, heads = tiny_llama
    # short prompts, one exactly at the chunk budget, and long ones split over 2-5 chunks
    lengths = [5, 17, CHUNK, CHUNK + 1, 150, 300]
    prompts = _prompts(heads.fingerprint.vocab_size, lengths, seed=0)
    records = _generate(engine, prompts)  # once each, of the prompt's length (the engine checks both)

    _check_states(records, prompts, model_dir)

    for record in records:
        state = torch.from_numpy(record.hidden_state().copy())
        # the heads ran on that state in the worker
        tensors = [torch.from_numpy(getattr(heads, n)) for n in ("w1", "b1", "w2", "b2", "thresholds")]
        logits, votes, decision = five_head_vote_reference(state[None], *tensors, min_votes=heads.min_votes)
        assert np.allclose(record.head_logits, logits[0].numpy(), atol=1e-3)
        margin = (logits[0] - tensors[4]).abs().min().item()
        if margin > 1e-3:
            assert record.votes == int(votes[0]) and record.compress_vote == bool(decision[0])


def test_prompt_logprobs_request_still_captured_once(tiny_llama):
    engine, model_dir, heads = tiny_llama
    prompts = _prompts(heads.fingerprint.vocab_size, [40, CHUNK + 30], seed=1)
    _check_states(_generate(engine, prompts, prompt_logprobs=1), prompts, model_dir)


def test_prefix_cache_hit_still_captured(tiny_llama):
    """A resent history mostly served from the prefix cache still completes its
    prefill in the engine and is captured, with the same state."""
    engine, _, heads = tiny_llama
    prompt = _prompts(heads.fingerprint.vocab_size, [200], seed=2)[0]
    [first] = _generate(engine, [prompt])
    [second] = _generate(engine, [prompt])
    assert engine.metric_total("vllm:prefix_cache_hits") > 0, "the second prompt was meant to hit the cache"
    assert np.allclose(first.hidden_state(), second.hidden_state(), atol=1e-4)


def _check_states(records, prompts, model_dir):
    """Each prompt's record (decode steps never captured: the engine refuses
    a second record) equal to HF transformers' final-norm last-token state."""
    reference = hf_last_token_states(model_dir, prompts)
    for record, prompt, expected in zip(records, prompts, reference, strict=True):
        state = torch.from_numpy(record.hidden_state().copy())
        cosine = torch.nn.functional.cosine_similarity(state, expected, dim=0).item()
        assert cosine >= 0.999, f"prompt of {len(prompt)} tokens: cosine {cosine:.5f}"


@pytest.mark.parametrize("kind", [kind for kind in ARCHITECTURES if kind != "llama"])
def test_every_architecture_is_captured(kind, tmp_path, tokenizer_dir):
    """Each architecture (besides Llama, above): one capture per request, the
    HF final-norm state, prompts over several prefill chunks. No code of the
    plugin names an architecture: the capture sits at ``compute_logits``."""
    engine, model_dir, heads = start_tiny_engine(kind, tmp_path, tokenizer_dir)
    with engine:
        prompts = _prompts(heads.fingerprint.vocab_size, [9, CHUNK + 40, 3 * CHUNK + 5], seed=3)
        records = _generate(engine, prompts)
        _check_states(records, prompts, model_dir)
        assert all(r.head_logits is not None and len(r.head_logits) == 5 for r in records)


def test_preempted_and_resumed_requests_are_captured_once(tmp_path, tokenizer_dir):
    """A KV cache too small for the batch: vLLM preempts running requests and
    re-prefills them (prompt and output so far) later; each is still captured
    once, at its prompt's last token."""
    engine, model_dir, heads = start_tiny_engine(
        # 9 blocks of 128 tokens (CPU): one request of the 1,024-token window fits, six growing ones do not
        "llama",
        tmp_path,
        tokenizer_dir,
        num_gpu_blocks_override=9,
        disable_log_stats=False,
    )
    with engine:
        prompts = _prompts(heads.fingerprint.vocab_size, [90, 100, 110, 95, 105, 85], seed=4)
        records = _generate(engine, prompts, max_tokens=150, ignore_eos=True)
        assert engine.metric_total("vllm:num_preemptions") > 0, "the batch was meant to be preempted"
        _check_states(records, prompts, model_dir)


def test_steps_with_speculative_draft_rows_capture_the_right_rows(tmp_path, tokenizer_dir):
    """n-gram speculative decoding: decoding requests carry draft rows in the
    sampling rows while later prompts complete their prefill in the same steps."""
    engine, model_dir, _ = start_tiny_engine(
        "llama",
        tmp_path,
        tokenizer_dir,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
        disable_log_stats=False,
    )
    with engine:
        rng = np.random.default_rng(5)
        # repeating prompts, so the n-gram proposer finds drafts in them
        prompts = [np.tile(rng.integers(100, 1000, size=n), 6).tolist() for n in (4, 5, 6, 7, 8, 9)]
        records = _generate(engine, prompts, max_tokens=40, ignore_eos=True)
        assert engine.metric_total("vllm:spec_decode_num_draft_tokens") > 0, "no draft was proposed"
        _check_states(records, prompts, model_dir)
