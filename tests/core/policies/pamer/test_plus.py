"""PaMER+ (``core/policies/pamer/plus.py``): step evidence on a real SQLite
store with scripted engine services (the selector's and the recall request's
answers are set per test), and the schema the selector is constrained to.
The engine path of the selector (structured outputs) runs in
tests/e2e/test_policies_serve.py."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.support.fakes import COMPRESS, KEEP, FakeEngine, blocking, conversation
from vllm_pamer.core.blocks import protocol_issues
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, PolicyRequest, create_policy
from vllm_pamer.core.policies.pamer.plus import EVIDENCE_HEADER, selection_schema
from vllm_pamer.core.policies.summary_writer import MEMORY_HEADER


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


def session_with_memory(store, policy):
    """Compress 8 blocks (memory 1 archives blocks 0-5), then return a later request."""
    context = PolicyContext(store, FakeEngine())
    out = asyncio.run(
        rewrite_request(
            policy, PolicyRequest(messages=conversation(8), session_id="s", previous_vote=COMPRESS, context=context)
        )
    )
    assert out.action == "compressed"
    return conversation(9)


def later(store, policy, services):
    return asyncio.run(
        rewrite_request(
            policy,
            PolicyRequest(
                messages=conversation(9), session_id="s", previous_vote=KEEP, context=PolicyContext(store, services)
            ),
        )
    )


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
