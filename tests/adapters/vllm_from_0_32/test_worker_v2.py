"""Model Runner V2's adapter (``adapters/vllm_from_0_32/worker_v2.py``) driven
through V2's own ``sample`` with real ``InputBatch`` values (V2 needs Triton
and pinned memory, so it cannot run on CPU: the request states are
stand-ins, the rest is vLLM's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.support.fakes import Sink
from vllm_pamer.adapters.vllm_from_0_32.models import capturing


class Generative(torch.nn.Module):
    """A generative model class (built here without an engine's config)."""

    def compute_logits(self, hidden_states):
        return hidden_states * 2


def _v2_batch(requests, drafts=None):
    """A real V2 ``InputBatch`` for requests (req_id, slot, computed, scheduled):
    rows ``logits_indices`` at each request's last scheduled token, and before it
    one per draft token, as V2's ``combine_sampled_and_draft_tokens`` places them."""
    import dataclasses

    import numpy as np
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    drafts = drafts or {}
    scheduled = np.array([r[3] for r in requests], dtype=np.int32)
    num_logits = np.array([1 + drafts.get(r[0], 0) for r in requests], dtype=np.int32)
    cu_logits = np.concatenate([[0], np.cumsum(num_logits)]).astype(np.int32)
    query_end = np.cumsum(scheduled)
    logits_indices = np.concatenate([np.arange(end - n, end) for end, n in zip(query_end, num_logits)])
    dummy = InputBatch.make_dummy(len(requests), int(scheduled.sum()), InputBuffers(8, 256, torch.device("cpu")))
    return dataclasses.replace(
        dummy,
        req_ids=[r[0] for r in requests],
        idx_mapping_np=np.array([r[1] for r in requests], dtype=np.intp),
        num_scheduled_tokens=scheduled,
        num_computed_tokens_np=np.array([r[2] for r in requests], dtype=np.int32),
        num_draft_tokens=int(sum(drafts.values())),
        has_prefill=True,
        cu_num_logits_np=cu_logits,
        logits_indices=torch.from_numpy(logits_indices),
    )


@pytest.fixture
def v2_runner(monkeypatch, tmp_path):
    """V2's ``GPUModelRunner`` with the plugin's hooks, as an object holding what
    ``sample`` reads, its model a capturing class, and a worker capture."""
    import numpy as np
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    import vllm_pamer.worker.capture as worker_capture
    from vllm_pamer.adapters.vllm_from_0_32 import worker_v2
    from vllm_pamer.core.heads import ModelFingerprint
    from vllm_pamer.settings import Settings

    fingerprint = ModelFingerprint("LlamaForCausalLM", hidden_size=4, num_hidden_layers=2, vocab_size=8, model_name="t")
    capture = worker_capture.WorkerCapture(Settings(), fingerprint, torch.device("cpu"))
    capture.publisher = Sink()
    monkeypatch.setattr(worker_capture, "_worker_capture", capture)
    worker_v2.install_runner_hook()
    model = object.__new__(capturing(Generative))  # built without an engine's config
    torch.nn.Module.__init__(model)
    model._pamer_capture = capture
    runner = object.__new__(GPUModelRunner)
    runner.batch_sharder = None
    runner.model = model
    runner.structured_outputs_worker = None
    runner.rejection_sampler = None
    runner.adaptive_verification = None
    runner.sampler = lambda logits, batch: SimpleNamespace(num_sampled=None, num_rejected=None)
    # slot -> prompt length (V2 keeps it in pinned memory, which CPU lacks)
    runner.req_states = SimpleNamespace(prompt_len=SimpleNamespace(np=np.array([5, 100, 100, 7, 9], dtype=np.int32)))
    return runner, capture


def _new_requests(*req_ids, key=True):
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=r, sampling_params=SimpleNamespace(extra_args={"pamer_capture": f"key-{r}"} if key else None)
            )
            for r in req_ids
        ]
    )


def test_v2_sample_captures_the_rows_completing_a_prompt(v2_runner):
    from vllm_pamer.adapters.vllm_from_0_32 import worker_v2

    runner, capture = v2_runner
    worker_v2._state(runner).add(_new_requests("short", "partial", "last", "spec"))
    # (req_id, slot, computed, scheduled): a whole prompt, a first chunk, a last
    # chunk, and a decode with two drafts (3 rows) in front of a last chunk
    batch = _v2_batch(
        [("spec", 4, 9, 3), ("short", 0, 0, 5), ("partial", 1, 0, 64), ("last", 2, 64, 36)], drafts={"spec": 2}
    )
    hidden = torch.randn(3 + 5 + 64 + 36, 4)
    runner.sample(hidden, batch, None)  # V2's own sample, wrapped
    got = {r.key: r for r in capture.publisher.records}
    assert set(got) == {"key-short", "key-last"}
    assert torch.allclose(torch.from_numpy(got["key-short"].hidden_state().copy()), hidden[3 + 4])
    assert torch.allclose(torch.from_numpy(got["key-last"].hidden_state().copy()), hidden[-1])
    assert got["key-last"].num_prompt_tokens == 100


def test_v2_one_capture_per_request_through_preemption_and_reuse(v2_runner):
    from vllm_pamer.adapters.vllm_from_0_32 import worker_v2

    runner, capture = v2_runner
    state = worker_v2._state(runner)
    state.add(_new_requests("a"))
    runner.sample(torch.randn(5, 4), _v2_batch([("a", 0, 0, 5)]), None)
    # preempted: V2 drops its state and re-adds it, re-prefilling prompt and output
    state.finish(SimpleNamespace(finished_req_ids=set(), preempted_req_ids={"a"}))
    state.add(_new_requests("a"))
    runner.sample(torch.randn(7, 4), _v2_batch([("a", 0, 0, 7)]), None)
    assert [r.key for r in capture.publisher.records] == ["key-a"]
    # finished, then the id reused by a new request: captured again
    state.finish(SimpleNamespace(finished_req_ids={"a"}, preempted_req_ids=set()))
    state.add(_new_requests("a"))
    runner.sample(torch.randn(5, 4), _v2_batch([("a", 0, 0, 5)]), None)
    assert [r.key for r in capture.publisher.records] == ["key-a", "key-a"]
    assert "a" not in state.finished  # handed to the capture with that step


def test_v2_request_without_extra_args_is_captured_keyless(v2_runner):
    from vllm_pamer.adapters.vllm_from_0_32 import worker_v2

    runner, capture = v2_runner
    worker_v2._state(runner).add(_new_requests("plain", key=False))
    runner.sample(torch.randn(5, 4), _v2_batch([("plain", 0, 0, 5)]), None)
    [record] = capture.publisher.records
    assert record.key is None  # the publisher drops keyless records (tests/test_channel.py)
