"""The worker capture (``worker/capture.py``) on hand-made step layouts: row
selection, probe-failure handling, and heads of another model refused at model
load (the real engine path is test_capture_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.support.fakes import Sink
from vllm_pamer.adapters.vllm_from_0_32.worker_v1 import V1Step
from vllm_pamer.channel import CAPTURE_KEY
from vllm_pamer.core.heads import HeadsMismatch, ModelFingerprint, random_heads, save_heads
from vllm_pamer.settings import Settings
from vllm_pamer.worker.capture import WorkerCapture

FP = ModelFingerprint("LlamaForCausalLM", hidden_size=16, num_hidden_layers=2, vocab_size=100, model_name="t")


def make_capture(tmp_path, heads=True, memory=True):
    path = tmp_path / "h.safetensors"
    save_heads(random_heads(FP), path)
    capture = WorkerCapture(Settings(heads=str(path) if heads else None), FP, torch.device("cpu"), memory=memory)
    capture.publisher = Sink()
    return capture


def step(requests, spec=None, finished=()):
    """requests: list of (req_id, computed, prompt, scheduled)."""
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(
            req_ids=[r[0] for r in requests],
            num_computed_tokens_cpu=np.array([r[1] for r in requests]),
            num_prompt_tokens=np.array([r[2] for r in requests]),
        ),
        requests={
            r[0]: SimpleNamespace(sampling_params=SimpleNamespace(extra_args={CAPTURE_KEY: f"key-{r[0]}"}))
            for r in requests
        },
    )
    scheduler_output = SimpleNamespace(
        num_scheduled_tokens={r[0]: r[3] for r in requests},
        scheduled_spec_decode_tokens=spec or {},
        finished_req_ids=set(finished),
    )
    return runner, scheduler_output


def test_only_rows_completing_their_prompt_are_captured(tmp_path):
    capture = make_capture(tmp_path)
    runner, out = step(
        [
            ("decode", 50, 20, 1),  # decode step: prompt done long ago
            ("partial", 0, 100, 64),  # first chunk of a long prompt
            ("last-chunk", 64, 100, 36),  # completes its prompt
            ("short", 0, 7, 7),  # whole prompt in one step
        ]
    )
    hidden = torch.randn(4, 16)
    capture.begin_step(V1Step(runner, out))
    capture.observe(hidden)
    got = {r.key: r for r in capture.publisher.records}
    assert set(got) == {"key-last-chunk", "key-short"}
    assert np.allclose(got["key-last-chunk"].hidden_state(), hidden[2].numpy())
    assert np.allclose(got["key-short"].hidden_state(), hidden[3].numpy())
    assert all(len(r.head_logits) == 5 for r in got.values())


def test_speculative_rows_shift_the_row_index(tmp_path):
    capture = make_capture(tmp_path)
    runner, out = step([("spec", 30, 10, 3), ("new", 0, 5, 5)], spec={"spec": [1, 2]})
    hidden = torch.randn(4, 16)  # 3 rows for "spec" (2 drafts + 1), then "new"
    capture.begin_step(V1Step(runner, out))
    capture.observe(hidden)
    [record] = capture.publisher.records
    assert record.key == "key-new" and np.allclose(record.hidden_state(), hidden[3].numpy())


def test_one_capture_per_request_and_disarmed_after_first_call(tmp_path):
    capture = make_capture(tmp_path)
    runner, out = step([("a", 0, 5, 5)])
    capture.begin_step(V1Step(runner, out))
    capture.observe(torch.randn(1, 16))
    capture.observe(torch.randn(1, 16))  # prompt-logprobs call in the same step
    capture.begin_step(V1Step(runner, out))  # re-prefill after preemption
    capture.observe(torch.randn(1, 16))
    assert len(capture.publisher.records) == 1
    capture.begin_step(V1Step(*step([], finished=["a"])))  # finished: the id may be reused
    assert "a" not in capture.captured


def test_unexpected_row_layout_captures_nothing(tmp_path):
    capture = make_capture(tmp_path)
    capture.begin_step(V1Step(*step([("a", 0, 5, 5)])))
    capture.observe(torch.randn(3, 16))  # 3 rows for 1 request: not a layout we know
    assert capture.publisher.records == []


def test_probe_failure_is_reported_not_fatal(tmp_path):
    """A head evaluation error (e.g. out of memory) still delivers the state,
    with no vote and the error, so the controller skips compression."""
    capture = make_capture(tmp_path)

    def failing_heads(rows):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    capture.heads = failing_heads
    capture.begin_step(V1Step(*step([("a", 0, 5, 5)])))
    capture.observe(torch.randn(1, 16))
    [record] = capture.publisher.records
    assert record.head_logits is None and record.votes is None and "out of memory" in record.heads_error


def test_no_heads_means_states_without_votes(tmp_path):
    capture = make_capture(tmp_path, heads=False)
    capture.begin_step(V1Step(*step([("a", 0, 5, 5)])))
    capture.observe(torch.randn(1, 16))
    [record] = capture.publisher.records
    assert record.head_logits is None and record.heads_error is None


def test_capture_off(tmp_path):
    capture = make_capture(tmp_path)
    capture.enabled = False
    capture.begin_step(V1Step(*step([("a", 0, 5, 5)])))
    capture.observe(torch.randn(1, 16))
    assert capture.publisher.records == []


def test_a_resumed_request_re_prefilling_past_its_prompt_is_not_captured_there(tmp_path):
    """After preemption vLLM re-prefills prompt and output: a chunk that runs
    past the prompt samples no prompt state (an uncaptured request stays so)."""
    capture = make_capture(tmp_path)
    capture.begin_step(V1Step(*step([("resumed", 0, 5, 9)])))  # 5 prompt + 4 output tokens at once
    capture.observe(torch.randn(1, 16))
    assert capture.publisher.records == []


def test_the_record_carries_the_workers_recall_for_its_session(tmp_path):
    from vllm_pamer.channel import SESSION_KEY

    capture = make_capture(tmp_path)
    memory = np.random.default_rng(0).standard_normal((3, 16)).astype("<f4")
    capture.memory.sync("s", [], [(i + 1, memory[i].tobytes()) for i in range(3)])
    runner, out = step([("mine", 0, 5, 5), ("other", 0, 5, 5)])
    runner.requests["mine"].sampling_params.extra_args[SESSION_KEY] = "s"
    runner.requests["other"].sampling_params.extra_args[SESSION_KEY] = "t"
    hidden = torch.from_numpy(np.stack([memory[1], memory[2]]))
    capture.begin_step(V1Step(runner, out))
    capture.observe(hidden)
    got = {r.key: r for r in capture.publisher.records}
    assert got["key-mine"].recall.ids[0] == 2 and got["key-mine"].recall.searched == (1, 2, 3)
    assert got["key-other"].recall is None  # session t holds no rows


def test_a_padded_one_token_prompt_remainder_is_captured_at_its_first_row(tmp_path):
    """With speculative decoding vLLM pads a one-token prompt remainder (a
    prefix-cache hit on all but the last token) with placeholder drafts: the
    prompt ends at the first of its rows."""
    capture = make_capture(tmp_path)
    runner, out = step([("hit", 49, 50, 4)], spec={"hit": [-1, -1, -1]})
    hidden = torch.randn(4, 16)
    capture.begin_step(V1Step(runner, out))
    capture.observe(hidden)
    [record] = capture.publisher.records
    assert np.allclose(record.hidden_state(), hidden[0].numpy())


def test_no_memory_rows_unless_the_api_server_can_push_them(tmp_path):
    assert make_capture(tmp_path, memory=False).memory is None


OTHER_MODEL = ModelFingerprint(
    "LlamaForCausalLM", hidden_size=64, num_hidden_layers=2, vocab_size=1000, model_name="other"
)


def test_worker_refuses_heads_of_another_model(tmp_path):
    """The plain `vllm serve` path: the worker checks the heads at model load."""
    heads = tmp_path / "other.safetensors"
    save_heads(random_heads(OTHER_MODEL), heads)
    served = ModelFingerprint(
        "LlamaForCausalLM", hidden_size=576, num_hidden_layers=30, vocab_size=49152, model_name="x"
    )
    with pytest.raises(HeadsMismatch, match="hidden_size"):
        WorkerCapture(Settings(heads=str(heads)), served, torch.device("cpu"))
    # the matching model loads
    assert WorkerCapture(Settings(heads=str(heads)), OTHER_MODEL, torch.device("cpu")).heads is not None
