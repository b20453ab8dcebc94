"""PaMER+ step evidence and PaMER's stable recall, on a real SQLite store with
scripted engine services (the selector's and the recall request's answers are
set per test). The engine path of the selector (structured outputs) runs in
tests/e2e/test_policies_serve.py."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import pytest

from tests.support.fakes import COMPRESS, KEEP, FakeEngine, blocking, conversation
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, create_policy
from vllm_pamer.core.policies.pamer.plus import EVIDENCE_HEADER, selection_schema
from vllm_pamer.core.policies.summary_writer import MEMORY_HEADER
from vllm_pamer.core.recall import stable_selection
from vllm_pamer.core.store import StepDetail
from vllm_pamer.stores.sqlite import SqliteStore


class ScriptedServices(FakeEngine):
    def __init__(self, selection, recall="ID3 is the value [step 1.3]", fail=None):
        super().__init__()
        self.selection, self.recall, self.fail = selection, recall, fail
        self.calls: list[tuple[str, object]] = []

    async def complete(self, messages, max_tokens, json_schema=None, kind="internal"):
        self.calls.append((kind, json_schema))
        if self.fail == kind:
            raise RuntimeError(f"{kind} engine error")
        if kind == "selector":
            return self.selection if isinstance(self.selection, str) else json.dumps(self.selection)
        return self.recall


@pytest.fixture
def store(tmp_path):
    return SqliteStore(tmp_path / "memory.sqlite3", model_fingerprint="test")


def session_with_memory(store, policy):
    """Compress 8 blocks (memory 1 archives blocks 0-5), then return a later request."""
    context = PolicyContext(store, FakeEngine())
    out = asyncio.run(rewrite_request(conversation(8), "s", policy, COMPRESS, context))
    assert out.action == "compressed"
    return conversation(9)


def later(store, policy, services):
    return asyncio.run(rewrite_request(conversation(9), "s", policy, KEEP, PolicyContext(store, services)))


def test_selected_steps_are_recalled_and_injected_after_the_summaries(store):
    policy = create_policy("pamer_plus")
    session_with_memory(store, policy)
    services = ScriptedServices({"summary_ids": [1], "raw_steps_needed": ["1.3"]})
    out = later(store, policy, services)
    assert out.action == "recalled" and protocol_issues(out.messages) == []
    assert out.recalled == (1,)  # the summaries shown, kept through the step evidence
    assert out.messages[2]["content"].startswith(MEMORY_HEADER)
    assert out.messages[3]["content"].startswith(f"{EVIDENCE_HEADER} 1.3:")
    assert [kind for kind, _ in services.calls] == ["selector", "recall"]
    _assert_bounds(services.calls[0][1], max_summaries=3, max_steps=8)  # top_k, max_selected_steps
    # the same selection again is a cache hit: no second recall request
    again = ScriptedServices({"summary_ids": [1], "raw_steps_needed": ["1.3"]})
    assert later(store, policy, again).messages == out.messages
    assert [kind for kind, _ in again.calls] == ["selector"]


def _assert_bounds(schema, max_summaries, max_steps):
    """The selector's answer is constrained to selections the policy can use:
    the schema accepts one and refuses too many ids, too many steps, a step
    that is not ``memory.step`` and any other field."""
    jsonschema.validate({"summary_ids": [1], "raw_steps_needed": ["1.3"]}, schema)
    jsonschema.validate({"summary_ids": [], "raw_steps_needed": []}, schema)
    refused = [
        {"summary_ids": list(range(max_summaries + 1)), "raw_steps_needed": []},
        {"summary_ids": [1], "raw_steps_needed": [f"1.{i}" for i in range(max_steps + 1)]},
        {"summary_ids": [1], "raw_steps_needed": ["1.x"]},
        {"summary_ids": [1], "raw_steps_needed": ["step 1.3"]},
        {"summary_ids": [1]},
        {"summary_ids": [1], "raw_steps_needed": [], "why": "extra"},
    ]
    for selection in refused:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(selection, schema)


def test_the_selection_schema_follows_the_options():
    _assert_bounds(selection_schema(1, 2), max_summaries=1, max_steps=2)


@pytest.mark.parametrize(
    "selection, rule",
    [
        ({"summary_ids": [1], "raw_steps_needed": ["1.99"]}, "does not exist"),
        ({"summary_ids": [7], "raw_steps_needed": ["7.0"]}, "not a memory"),
        ({"summary_ids": [], "raw_steps_needed": ["1.0"]}, "no selected summary"),
        ('{"summary_ids": [1]', "not a selection"),
    ],
)
def test_invalid_selection_injects_nothing_and_keeps_the_pamer_request(store, selection, rule):
    policy = create_policy("pamer_plus")
    session_with_memory(store, policy)
    plain = later(store, create_policy("pamer", {"schedule": "paper"}), FakeEngine())
    out = later(store, policy, ScriptedServices(selection))
    assert out.messages == plain.messages and rule in out.detail
    assert any(e["kind"] == "step_selection_rejected" for e in blocking(store).events("s"))


def test_empty_selection_and_failures_inject_nothing(store):
    policy = create_policy("pamer_plus")
    session_with_memory(store, policy)
    plain = later(store, create_policy("pamer", {"schedule": "paper"}), FakeEngine()).messages
    assert later(store, policy, ScriptedServices({"summary_ids": [], "raw_steps_needed": []})).messages == plain
    for kind in ("selector", "recall"):
        out = later(store, policy, ScriptedServices({"summary_ids": [1], "raw_steps_needed": ["1.2"]}, fail=kind))
        assert out.messages == plain and out.action == "recalled"
    # a recall citing a step it was not given is rejected
    foreign = ScriptedServices({"summary_ids": [1], "raw_steps_needed": ["1.4"]}, recall="x [step 1.0]")
    assert later(store, policy, foreign).messages == plain


def test_step_evidence_that_would_not_fit_the_window_is_left_out(store):
    policy = create_policy("pamer_plus")
    session_with_memory(store, policy)
    plain = later(store, create_policy("pamer", {"schedule": "paper"}), FakeEngine()).messages
    services = ScriptedServices({"summary_ids": [1], "raw_steps_needed": ["1.3"]}, recall="ID3 " * 400 + "[step 1.3]")
    services.max_model_len = services.count_tokens(plain) + 100  # the request fits, the evidence does not
    out = later(store, policy, services)
    assert out.messages == plain and out.action == "recalled" and "would not fit the window" in out.detail


def test_stable_selection_keeps_previous_unless_beaten_by_margin():
    scores = {1: 0.50, 2: 0.48, 3: 0.47, 4: 0.49, 5: 0.60}
    assert stable_selection(scores, [], [5, 1, 4], 3, 0.05) == [1, 4, 5]
    # 4 now outscores 3 but only by 0.02: the previous set stays
    assert stable_selection(scores, [1, 2, 3], [1, 4, 2], 3, 0.05) == [1, 2, 3]
    # 5 beats the weakest (3, 0.47) by 0.13: it replaces it
    assert stable_selection(scores, [1, 2, 3], [5, 1, 4], 3, 0.05) == [1, 2, 5]
    # vanished members drop out, free places fill from the fresh list
    assert stable_selection({1: 0.5, 4: 0.1}, [1, 9], [4, 1], 3, 0.05) == [1, 4]


def test_pamer_recall_text_stays_identical_while_the_query_drifts(store):
    """Four memories, Top-2: plain Top-K flips between requests whose queries
    differ slightly, stable recall sends the same text."""
    services = FakeEngine()
    archived = split_conversation(conversation(7)).blocks[3:]  # not in the requests below
    for i, block in enumerate(archived):
        vector = np.eye(64, dtype=np.float32)[i] + 0.5
        detail = StepDetail(step=0, block_id=block.block_id, tool_names=("lookup",), chars=100)
        blocking(store).commit_memory("s", f"memory about topic {i}", vector, services.embedder_name, [block], [detail])
    queries = [np.eye(64)[0] * 1.0 + np.eye(64)[1] * 0.98, np.eye(64)[0] * 0.98 + np.eye(64)[1] + np.eye(64)[2] * 1.01]

    def recalled(policy):
        texts, ids = [], []
        for q in queries:
            services.embed = lambda text, q=q: asyncio.sleep(0, result=q.astype(np.float32))
            out = asyncio.run(rewrite_request(conversation(3), "s", policy, KEEP, PolicyContext(store, services)))
            texts.append(out.messages[2]["content"])
            ids.append(out.recalled)
        return texts, ids

    plain, plain_ids = recalled(create_policy("pamer", {"schedule": "paper", "top_k": 2, "stable_recall": False}))
    stable, stable_ids = recalled(create_policy("pamer", {"schedule": "paper", "top_k": 2}))
    assert plain[0] != plain[1] and plain_ids[0] != plain_ids[1]
    assert stable[0] == stable[1] == plain[0]
    assert stable_ids[0] == stable_ids[1] == plain_ids[0]


def test_selection_schema_accepts_exactly_the_selection_shape():
    import msgspec

    from vllm_pamer.core.policies.pamer.selection import StepSelection

    schema = selection_schema(3, 8)
    assert set(schema["properties"]) == set(StepSelection.__struct_fields__)
    assert set(schema["required"]) == set(StepSelection.__struct_fields__)
    msgspec.json.decode(b'{"summary_ids": [1], "raw_steps_needed": ["1.3"]}', type=StepSelection)


def test_selection_schema_follows_top_k():
    """The selector may name as many summaries as recall shows (was: 3 whatever top_k said)."""
    policy = create_policy("pamer_plus", {"top_k": 5, "max_selected_steps": 4})
    schema = selection_schema(policy.config.top_k, policy.config.max_selected_steps)
    assert schema["properties"]["summary_ids"]["maxItems"] == 5
    assert schema["properties"]["raw_steps_needed"]["maxItems"] == 4
