"""Capture on a real vLLM engine (offline ``LLM``) with tiny random models:
the captured row is the final-norm state of the last prompt token (compared
to HF transformers), exactly once per request, also when the prompt is split
over several prefill chunks, asks for prompt logprobs, is preempted and
resumed, or shares its step with speculative draft rows."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch

from tests.engine.tiny_models import ARCHITECTURES, build_tiny_model, hf_last_token_states
from vllm_pamer.channel import CAPTURE_KEY, CHANNEL_ENV, CaptureReceiver
from vllm_pamer.core.heads import load_heads, random_heads, save_heads
from vllm_pamer.kernels import five_head_vote_reference
from vllm_pamer.model_config import model_fingerprint

pytestmark = pytest.mark.engine

CHUNK = 64  # prefill token budget per step: prompts above it are chunked


def start_tiny_engine(kind: str, root, tokenizer_dir, **engine_args):
    """A real vLLM engine on a tiny random ``kind`` model, with random heads and
    a capture collector bound in this process (``engine_args``: more of ``LLM``'s)."""
    from vllm import LLM

    model_dir = build_tiny_model(kind, root / "model", tokenizer_dir)
    heads_path = root / "heads.safetensors"
    fingerprint = model_fingerprint(model_dir, f"tiny-{kind}")
    save_heads(random_heads(fingerprint, seed=1), heads_path)
    address = f"ipc://{root}/capture.sock"
    collector = CaptureReceiver(address)
    saved = {k: os.environ.get(k) for k in (CHANNEL_ENV, "PAMER_HEADS")}
    os.environ[CHANNEL_ENV] = address  # inherited by the engine's processes
    os.environ["PAMER_HEADS"] = str(heads_path)
    try:
        llm = LLM(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=1024,
            max_num_batched_tokens=CHUNK,
            max_num_seqs=8,
            enable_chunked_prefill=True,
            gpu_memory_utilization=0.15,
            seed=0,
            **engine_args,
        )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return llm, collector, model_dir, load_heads(heads_path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir):
    engine = start_tiny_engine("llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)
    yield engine
    engine[0].llm_engine.engine_core.shutdown()  # now, not at interpreter exit


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 1, size=n).tolist() for n in lengths]


def _generate(llm, prompts, **params):
    from vllm import SamplingParams, TokensPrompt

    keys = [uuid.uuid4().hex for _ in prompts]
    params = {"max_tokens": 4, **params}
    sampling = [SamplingParams(temperature=0.0, extra_args={CAPTURE_KEY: key}, **params) for key in keys]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    return keys


def test_one_capture_per_request_matching_hf(tiny_llama):
    llm, collector, model_dir, heads = tiny_llama
    # short prompts, one exactly at the chunk budget, and long ones split over 2-5 chunks
    lengths = [5, 17, CHUNK, CHUNK + 1, 150, 300]
    prompts = _prompts(heads.fingerprint.vocab_size, lengths, seed=0)
    keys = _generate(llm, prompts)
    records = collector.drain(expect=len(prompts))

    _check_states(records, keys, prompts, model_dir)  # once per request, equal to HF's state

    by_key = {r.key: r for r in records}
    for key, prompt in zip(keys, prompts):
        record = by_key[key]
        assert record.num_prompt_tokens == len(prompt)
        state = torch.from_numpy(record.hidden_state().copy())
        # the heads ran on that state in the worker
        tensors = [torch.from_numpy(getattr(heads, n)) for n in ("w1", "b1", "w2", "b2", "thresholds")]
        logits, votes, decision = five_head_vote_reference(state[None], *tensors, min_votes=heads.min_votes)
        assert np.allclose(record.head_logits, logits[0].numpy(), atol=1e-3)
        margin = (logits[0] - tensors[4]).abs().min().item()
        if margin > 1e-3:
            assert record.votes == int(votes[0]) and record.compress_vote == bool(decision[0])


def test_prompt_logprobs_request_still_captured_once(tiny_llama):
    llm, collector, _, heads = tiny_llama
    prompts = _prompts(heads.fingerprint.vocab_size, [40, CHUNK + 30], seed=1)
    keys = _generate(llm, prompts, prompt_logprobs=1)
    records = collector.drain(expect=len(prompts))
    assert sorted(r.key for r in records) == sorted(keys)


def test_prefix_cache_hit_still_captured(tiny_llama):
    """A resent history mostly served from the prefix cache still completes its
    prefill in the engine and is captured, with the same state."""
    llm, collector, _, heads = tiny_llama
    prompt = _prompts(heads.fingerprint.vocab_size, [200], seed=2)[0]
    first = _generate(llm, [prompt])
    second = _generate(llm, [prompt])
    records = {r.key: r for r in collector.drain(expect=2)}
    assert set(records) == {first[0], second[0]}
    a, b = (records[first[0]].hidden_state(), records[second[0]].hidden_state())
    assert np.allclose(a, b, atol=1e-4)


def _check_states(records, keys, prompts, model_dir):
    """Exactly one record per request (decode steps never), each equal to HF
    transformers' final-norm last-token state."""
    by_key = {r.key: r for r in records}
    assert len(by_key) == len(records), "a request was captured twice"
    assert set(by_key) == set(keys), "every request is captured exactly once"
    reference = hf_last_token_states(model_dir, prompts)
    for key, prompt, expected in zip(keys, prompts, reference):
        state = torch.from_numpy(by_key[key].hidden_state().copy())
        cosine = torch.nn.functional.cosine_similarity(state, expected, dim=0).item()
        assert cosine >= 0.999, f"prompt of {len(prompt)} tokens: cosine {cosine:.5f}"


@pytest.mark.parametrize("kind", [kind for kind in ARCHITECTURES if kind != "llama"])
def test_every_architecture_is_captured(kind, tmp_path, tokenizer_dir):
    """Each architecture (besides Llama, above): one capture per request, the
    HF final-norm state, prompts over several prefill chunks. No code of the
    plugin names an architecture: the capture sits at ``compute_logits``."""
    llm, collector, model_dir, heads = start_tiny_engine(kind, tmp_path, tokenizer_dir)
    try:
        prompts = _prompts(heads.fingerprint.vocab_size, [9, CHUNK + 40, 3 * CHUNK + 5], seed=3)
        keys = _generate(llm, prompts)
        records = collector.drain(expect=len(prompts))
        _check_states(records, keys, prompts, model_dir)
        assert all(r.head_logits is not None and len(r.head_logits) == 5 for r in records)
    finally:
        llm.llm_engine.engine_core.shutdown()


def _counter(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def test_preempted_and_resumed_requests_are_captured_once(tmp_path, tokenizer_dir):
    """A KV cache too small for the batch: vLLM preempts running requests and
    re-prefills them (prompt and output so far) later; each is still captured
    once, at its prompt's last token."""
    llm, collector, model_dir, heads = start_tiny_engine(
        # 9 blocks of 128 tokens (CPU): one request of the 1,024-token window fits, six growing ones do not
        "llama",
        tmp_path,
        tokenizer_dir,
        num_gpu_blocks_override=9,
        disable_log_stats=False,
    )
    try:
        prompts = _prompts(heads.fingerprint.vocab_size, [90, 100, 110, 95, 105, 85], seed=4)
        keys = _generate(llm, prompts, max_tokens=150, ignore_eos=True)
        records = collector.drain(expect=len(prompts))
        assert _counter(llm, "vllm:num_preemptions") > 0, "the batch was meant to be preempted"
        _check_states(records, keys, prompts, model_dir)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_steps_with_speculative_draft_rows_capture_the_right_rows(tmp_path, tokenizer_dir):
    """n-gram speculative decoding: decoding requests carry draft rows in the
    sampling rows while later prompts complete their prefill in the same steps."""
    llm, collector, model_dir, _ = start_tiny_engine(
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
    try:
        rng = np.random.default_rng(5)
        # repeating prompts, so the n-gram proposer finds drafts in them
        prompts = [np.tile(rng.integers(100, 1000, size=n), 6).tolist() for n in (4, 5, 6, 7, 8, 9)]
        keys = _generate(llm, prompts, max_tokens=40, ignore_eos=True)
        records = collector.drain(expect=len(prompts))
        assert _counter(llm, "vllm:spec_decode_num_draft_tokens") > 0, "no draft was proposed"
        _check_states(records, keys, prompts, model_dir)
    finally:
        llm.llm_engine.engine_core.shutdown()
