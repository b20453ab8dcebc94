"""The reference annotator (``training/annotate.py``): the recall/compression
rule on hand-made conversations, agreement with a direct (slow) reading of
the rule on the shipped trajectories, determinism, the tokenizer count and
the registry."""

from __future__ import annotations

import copy

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.chat_strategies import valid_messages
from tests.support.messages import call, result, say, user
from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.salient import action_values, message_text, occurs
from vllm_pamer.training import annotate as A
from vllm_pamer.training.annotate import (
    Annotator,
    AnnotatorSettings,
    DecisionPoint,
    UnknownAnnotator,
    annotate_trajectory,
    char_counter,
    create_annotator,
    decision_contexts,
)
from vllm_pamer.trajectories import agent_requests, load_trajectories

SYSTEM = {"role": "system", "content": "You are an airline agent."}


def trajectory(*messages, id="t"):
    return {"id": id, "source": "hand", "messages": list(messages)}


def by_index(points):
    return {p.message_index: p for p in points}


FILLER = "lorem ipsum dolor sit amet " * 200  # ~5400 characters: > 1024 tokens by chars // 4


# P = system + user; blocks b0..b3; the decision at the last action has
# O = [b0, b1] and R = [b2, b3].
BASE = [
    SYSTEM,
    user("Hi, my user id is mia_li_3668."),
    call("c0", "get_user_details", user_id="mia_li_3668"),  # b0
    result("c0", '{"reservations": ["XAZ3C0"], "payment": "gift_card_8887175"}'),
    say("Which reservation?"),  # b1
    user("The one from last week."),
    call("c2", "think", thought="look it up"),  # b2
    result("c2", ""),
    say("One moment."),  # b3
    user("Sure."),
]


def test_value_only_in_old_blocks_is_recall():
    traj = trajectory(*BASE, call("c4", "get_reservation_details", reservation_id="XAZ3C0"), result("c4", "ok"))
    point = by_index(annotate_trajectory(traj, char_counter))[10]
    assert (point.n_old_blocks, point.recall, point.recall_values) == (2, 1, ["XAZ3C0"])


def test_value_also_in_recent_blocks_is_no_recall():
    messages = copy.deepcopy(BASE)
    messages[9] = user("Sure, it is XAZ3C0.")  # now in R as well
    traj = trajectory(*messages, call("c4", "get_reservation_details", reservation_id="XAZ3C0"), result("c4", "ok"))
    point = by_index(annotate_trajectory(traj, char_counter))[10]
    assert (point.recall, point.recall_values) == (0, [])


def test_value_in_prefix_is_no_recall():
    traj = trajectory(*BASE, call("c4", "get_user_details", user_id="mia_li_3668"), result("c4", "ok"))
    assert by_index(annotate_trajectory(traj, char_counter))[10].recall == 0


def test_value_the_agent_introduced_itself_is_no_recall():
    # HAT999 first appears in the agent's own message (b1), not in an observation.
    messages = copy.deepcopy(BASE)
    messages[4] = say("I could book HAT999 for you.")
    traj = trajectory(*messages, say("Shall I book HAT999?"))
    assert by_index(annotate_trajectory(traj, char_counter))[10].recall == 0


def test_no_old_blocks_means_recall_and_compression_are_none():
    points = annotate_trajectory(trajectory(*BASE, say("Done.")), char_counter)
    assert [(p.message_index, p.n_old_blocks) for p in points] == [(2, 0), (4, 0), (6, 0), (8, 1), (10, 2)]
    assert all(p.recall is None and p.compression is None for p in points[:3])
    assert points[3].recall == 0


def test_small_old_history_means_compression_is_none():
    traj = trajectory(*BASE, call("c4", "get_reservation_details", reservation_id="XAZ3C0"), result("c4", "ok"))
    point = by_index(annotate_trajectory(traj, char_counter))[10]
    assert point.old_tokens < 1024 and point.compression is None and point.recall == 1


def _long_history(tail):
    """P, then b0 with a large observation holding HAT500, then b1, b2, then
    ``tail`` from message 8: the decision at message 8 has O = [b0], R = [b1, b2]."""
    return trajectory(
        SYSTEM,
        user("Find a flight."),
        call("c0", "search", origin="JFK"),  # b0 (old at message 6)
        result("c0", FILLER + " HAT500 " + FILLER),
        say("Checking."),  # b1
        user("ok"),
        say("Still checking."),  # b2
        user("ok"),
        *tail,
    )


def test_stale_old_history_is_compression():
    traj = _long_history([say("Anything else?"), user("no"), say("Bye."), user("bye"), say("Goodbye.")])
    point = by_index(annotate_trajectory(traj, char_counter))[8]
    assert point.n_old_blocks == 1 and point.old_tokens >= 1024
    assert (point.compression, point.compression_values) == (1, [])


def test_old_value_used_within_horizon_is_no_compression():
    # a_t (message 8) does not use HAT500, a_t+2 (message 12) does: recall 0, compression 0.
    traj = _long_history([say("Anything else?"), user("no"), say("One more."), user("ok"), say("Book HAT500?")])
    point = by_index(annotate_trajectory(traj, char_counter))[8]
    assert (point.recall, point.compression, point.compression_values) == (0, 0, ["HAT500"])


def test_old_value_used_after_the_horizon_is_compression():
    traj = _long_history([say("a"), user("no"), say("b"), user("ok"), say("c"), user("ok"), say("Book HAT500?")])
    points = by_index(annotate_trajectory(traj, char_counter))
    assert points[8].compression == 1  # HAT500 comes back at the 4th action
    assert points[10].compression == 0 and points[10].compression_values == ["HAT500"]


def test_value_repeated_after_the_decision_is_not_old_evidence():
    # The next action's tool result repeats HAT500: a_t+1 may read it there.
    traj = _long_history([call("c6", "search", origin="JFK"), result("c6", "HAT500"), say("Book HAT500?")])
    assert by_index(annotate_trajectory(traj, char_counter))[8].compression == 1


def test_horizon_and_gate_are_settings():
    traj = _long_history([say("Anything else?"), user("no"), say("One more."), user("ok"), say("Book HAT500?")])
    assert by_index(annotate_trajectory(traj, char_counter, horizon=2))[8].compression == 1
    assert by_index(annotate_trajectory(traj, char_counter, min_old_tokens=10**6))[8].compression is None


def test_metadata_fields():
    traj = trajectory(*BASE, say("Done."))
    points = annotate_trajectory(traj, char_counter)
    last = points[-1]
    assert (last.trajectory_id, last.source, last.step, last.n_messages) == ("t", "hand", 4, 10)
    assert last.turn == 3  # user messages before the decision
    assert last.last_tool == "think"
    assert points[0].last_tool is None and points[0].turn == 1
    assert last.old_tokens == char_counter(BASE[2:4]) + char_counter(BASE[4:6])


def test_annotation_does_not_touch_its_input():
    traj = _long_history([say("Book HAT500?")])
    before = copy.deepcopy(traj)
    annotate_trajectory(traj, char_counter)
    assert traj == before


@settings(max_examples=60, deadline=None)
@given(valid_messages(max_blocks=7), st.integers(0, 3))
def test_contexts_match_split_conversation(messages, n_recent):
    contexts = decision_contexts({"messages": messages}, char_counter, AnnotatorSettings(n_recent=n_recent))
    requests = list(agent_requests(messages))
    assert [c.message_index for c in contexts] == [i for i, _ in requests]
    for ctx, (i, history) in zip(contexts, requests):
        conversation = split_conversation(history)
        old, recent = conversation.old_and_recent(n_recent)
        assert messages[: ctx.prefix_end] == list(conversation.prefix)
        assert messages[ctx.prefix_end : ctx.old_end] == [m for b in old for m in b.messages]
        assert messages[ctx.old_end : i] == [m for b in recent for m in b.messages]
        assert (ctx.n_old_blocks, ctx.n_recent_blocks) == (len(old), len(recent))
        assert ctx.old_tokens == sum(char_counter(b.messages) for b in old)


def _naive(traj, n_recent=2, horizon=3, min_old_tokens=1024):
    """The rule read literally: split every request, search the texts."""
    messages = traj["messages"]
    requests = list(agent_requests(messages))

    def first_is_observation(value):
        first = next(m for m in messages if occurs(value, message_text(m)))
        return first["role"] != "assistant"

    def in_any(value, group):
        return any(occurs(value, message_text(m)) for m in group)

    out = []
    for j, (i, history) in enumerate(requests):
        conversation = split_conversation(history)
        old, recent = conversation.old_and_recent(n_recent)
        p = list(conversation.prefix)
        o = [m for b in old for m in b.messages]
        r = [m for b in recent for m in b.messages]

        def old_only(value, until):
            newer = r + messages[i:until]
            return (
                in_any(value, o) and not in_any(value, p) and not in_any(value, newer) and first_is_observation(value)
            )

        recall = None
        if old:
            recall = int(any(old_only(v, i) for v in action_values(messages[i])))
        compression = None
        if old and sum(char_counter(b.messages) for b in old) >= min_old_tokens:
            later = [a for a, _ in requests[j : j + horizon]]
            compression = int(not any(old_only(v, a) for a in later for v in action_values(messages[a])))
        out.append((i, recall, compression))
    return out


@pytest.mark.parametrize("kind", ["tau", "swe"])
def test_fast_annotation_matches_the_naive_rule_on_shipped_trajectories(kind):
    for traj in load_trajectories(None, kind)[:2]:
        fast = [(p.message_index, p.recall, p.compression) for p in annotate_trajectory(traj, char_counter)]
        assert fast == _naive(traj)


def test_shipped_trajectories_have_both_labels():
    points = [
        p
        for kind in ("tau", "swe")
        for t in load_trajectories(None, kind)
        for p in annotate_trajectory(t, char_counter)
    ]
    assert {p.recall for p in points} == {None, 0, 1}
    assert {p.compression for p in points} == {None, 0, 1}
    for p in points:
        assert (p.recall == 1) == bool(p.recall_values)
        assert (p.compression == 0) == bool(p.compression_values)
        if p.recall == 1 and p.compression is not None:
            assert p.compression == 0  # a value needed now keeps the old history


def test_annotation_of_a_shipped_trajectory_is_deterministic():
    traj = load_trajectories(None, "swe")[0]
    first = msgspec.json.encode(annotate_trajectory(traj, char_counter))
    again = msgspec.json.encode(annotate_trajectory(copy.deepcopy(traj), char_counter, token_cache={}))
    assert first == again


def test_tokenizer_counter_counts_the_plain_text(tokenizer_dir):
    from tokenizers import Tokenizer

    from vllm_pamer.core.text import serialize_messages

    count = A.tokenizer_counter(tokenizer_dir)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    messages = BASE[2:6]
    expected = len(tokenizer.encode(serialize_messages(messages), add_special_tokens=False).ids)
    assert count(messages) == expected > 0
    assert count([]) == 0
    assert count([user("hello world")]) == 4  # "user", ":", " hello", " world"


def test_reference_annotator_from_the_registry():
    annotator = create_annotator("reference", AnnotatorSettings(horizon=2), char_counter)
    assert isinstance(annotator, Annotator) and annotator.name == "reference"
    assert "reference" in A.available_annotators()
    traj = _long_history([say("Anything else?"), user("no"), say("One more."), user("ok"), say("Book HAT500?")])
    assert annotator.annotate(traj) == annotate_trajectory(traj, char_counter, horizon=2)


def test_unknown_annotator_is_refused():
    with pytest.raises(UnknownAnnotator, match=r"available: .*reference"):
        create_annotator("nope", count_tokens=char_counter)


def test_a_second_annotator_plugs_in(monkeypatch):
    monkeypatch.setattr(A, "_REGISTRY", dict(A._REGISTRY))

    @A.register_annotator("always-recall")
    class AlwaysRecall:
        name = "always-recall"

        def __init__(self, settings, count_tokens):
            self.settings, self.count_tokens = settings, count_tokens

        def annotate(self, trajectory):
            return [
                DecisionPoint(
                    trajectory_id=trajectory["id"],
                    step=c.step,
                    message_index=c.message_index,
                    n_messages=c.message_index,
                    n_old_blocks=c.n_old_blocks,
                    old_tokens=c.old_tokens,
                    turn=c.turn,
                    last_tool=c.last_tool,
                    recall=1 if c.n_old_blocks else None,
                    compression=None,
                    recall_values=[],
                    source=trajectory["source"],
                    annotator=self.name,
                )
                for c in decision_contexts(trajectory, self.count_tokens, self.settings)
            ]

    points = create_annotator("always-recall", count_tokens=char_counter).annotate(trajectory(*BASE, say("x")))
    assert [p.recall for p in points] == [None, None, None, 1, 1]
    with pytest.raises(ValueError, match="already registered"):
        A.register_annotator("always-recall")(lambda settings, count_tokens: None)
