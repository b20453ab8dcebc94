"""The metadata control as the band's trigger (``core/policies/pamer/control_vote.py``):
its features are the annotator's own (so a control fitted on annotated points
reads a served request the same way), its arithmetic, and the shipped file."""

from __future__ import annotations

import math

import msgspec
import pytest

from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.core.policies.pamer.control_vote import (
    NUMERIC,
    ControlTrigger,
    feature_vector,
    load_control_trigger,
    request_features,
)
from vllm_pamer.core.text import serialize_messages
from vllm_pamer.training.annotate import annotate_trajectory, char_counter
from vllm_pamer.trajectories import SHIPPED, load_trajectories


@pytest.mark.parametrize("kind", sorted(SHIPPED))
def test_a_request_s_features_are_what_the_annotator_counts_at_its_decision_point(kind):
    trajectory = load_trajectories(None, kind)[0]
    messages = trajectory["messages"]
    points = annotate_trajectory(trajectory, char_counter)
    assert any(p.old_tokens > 0 for p in points) and any(p.last_tool for p in points)
    for point in points:
        request = messages[: point.message_index]
        conversation = split_conversation(request)
        features = request_features(conversation.prefix, conversation.blocks, request, n_recent=2)
        assert features["old_tokens"] == point.old_tokens
        assert features["turn"] == point.turn
        assert features["last_tool"] == (point.last_tool or "<none>")
        assert features["assistant_turns"] == sum(1 for m in request if m["role"] == "assistant")
        assert features["context_tokens"] == len(serialize_messages(request)) // 4


def _trigger(**fields) -> ControlTrigger:
    width = 2 * len(NUMERIC) + 2
    base = {"tools": ["bash", "<none>"], "mean": [0.0] * width, "scale": [1.0] * width, "weights": [0.0] * width}
    return ControlTrigger(**{**base, "bias": 0.0, **fields})


def test_the_logit_is_the_weighted_standardized_features_plus_the_bias():
    features = {"context_tokens": 3000, "kept_tokens": 500, "old_tokens": 2000, "turn": 1, "assistant_turns": 12}
    features |= {"last_tool": "bash"}
    x = feature_vector(features, ["bash", "<none>"])
    assert x[:2] == [math.log1p(3000), 3.0] and x[-2:] == [1.0, 0.0]
    weights = [0.0] * len(x)
    weights[NUMERIC.index("assistant_turns") * 2 + 1] = 100.0  # assistant_turns / 1000, so 1.2 here
    trigger = _trigger(weights=weights, bias=-1.0, mean=[0.0] * len(x), scale=[2.0] * len(x))
    assert trigger.logit(features) == pytest.approx(-1.0 + 100.0 * 0.012 / 2.0)
    assert trigger.logit({**features, "last_tool": "python"}) == trigger.logit(features)  # unseen tool: no column


def test_a_control_of_the_wrong_width_or_a_zero_scale_is_refused():
    with pytest.raises(ValueError, match="needs 12 means"):
        ControlTrigger(tools=["bash", "x"], mean=[0.0], scale=[1.0], weights=[0.0], bias=0.0)
    with pytest.raises(ValueError, match="scales > 0"):
        _trigger(scale=[0.0] * 12)


def test_the_shipped_control_was_fitted_on_the_tuning_split_and_tells_requests_apart():
    trigger = load_control_trigger()
    assert "tuning split" in trigger.trained_on and "compression" in trigger.trained_on
    said = set()
    for kind in sorted(SHIPPED):
        for trajectory in load_trajectories(None, kind):
            messages = trajectory["messages"]
            for i in range(1, len(messages)):
                if messages[i]["role"] == "assistant":
                    conversation = split_conversation(messages[:i])
                    said.add(trigger.compress(conversation.prefix, conversation.blocks, messages[:i]))
    assert said == {True, False}
    assert msgspec.json.decode(msgspec.json.encode(trigger), type=ControlTrigger) == trigger
