"""Properties of the block splitter and the tool-call protocol check."""

from __future__ import annotations

import copy

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.support.chat_strategies import ID_ALPHABET, UNKNOWN_ID, conversations, join, valid_messages
from vllm_pamer.core.blocks import (
    Block,
    MalformedRequest,
    block_id,
    check_message_shape,
    last_tool,
    protocol_issues,
    split_conversation,
)


def _offset(prefix, parts, block_index: int) -> int:
    """Index, in the joined list, of the first message of ``parts[block_index]``."""
    return len(prefix) + sum(len(b) for b in parts[:block_index])


def _tool_positions(parts) -> list[tuple[int, int]]:
    return [(bi, mi) for bi, block in enumerate(parts) for mi, m in enumerate(block) if m["role"] == "tool"]


# --- split_conversation ------------------------------------------------------


@given(conversations())
def test_split_rejoins_to_the_same_objects(conv):
    prefix, parts = conv
    messages = join(prefix, parts)
    joined = split_conversation(messages).messages()
    assert joined == messages
    assert len(joined) == len(messages)
    assert all(a is b for a, b in zip(joined, messages))


@given(conversations())
def test_split_finds_the_generated_prefix_and_blocks(conv):
    prefix, parts = conv
    split = split_conversation(join(prefix, parts))
    assert list(split.prefix) == prefix
    assert all(m["role"] != "assistant" for m in split.prefix)
    assert [list(b.messages) for b in split.blocks] == parts
    for block in split.blocks:
        assert block.messages[0]["role"] == "assistant"
        assert block.assistant is block.messages[0]
        assert all(m["role"] != "assistant" for m in block.messages[1:])
        assert block.tool_call_ids() == [c["id"] for c in block.assistant.get("tool_calls") or []]


def test_split_of_a_conversation_without_assistant_is_all_prefix():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    split = split_conversation(messages)
    assert split.prefix == tuple(messages)
    assert split.blocks == ()


@given(conversations())
def test_valid_conversations_have_no_protocol_issues(conv):
    assert protocol_issues(join(*conv)) == []


@given(conversations(), st.integers(min_value=1, max_value=8))
def test_old_and_recent_partition_the_blocks(conv, k):
    split = split_conversation(join(*conv))
    old, recent = split.old_and_recent(k)
    assert old + recent == split.blocks
    assert len(recent) == min(k, len(split.blocks))


@given(conversations())
def test_old_and_recent_with_zero_keeps_nothing_recent(conv):
    split = split_conversation(join(*conv))
    assert split.old_and_recent(0) == (split.blocks, ())


# --- block_id ----------------------------------------------------------------


@given(conversations(min_blocks=1))
def test_block_id_is_stable_across_deep_copies(conv):
    _prefix, parts = conv
    for block in parts:
        assert block_id(block) == block_id(copy.deepcopy(block))
        assert Block(tuple(block)).block_id == block_id(block)


@given(conversations(min_blocks=1), st.data())
def test_block_id_changes_when_a_tool_result_changes(conv, data):
    _prefix, parts = conv
    positions = _tool_positions(parts)
    assume(positions)
    bi, mi = data.draw(st.sampled_from(positions))
    changed = copy.deepcopy(parts[bi])
    changed[mi]["content"] = changed[mi]["content"] + "!"
    assert block_id(changed) != block_id(parts[bi])


def test_block_id_ignores_keys_outside_the_protocol_content():
    block = [{"role": "assistant", "content": "hi"}]
    assert block_id(block) == block_id([{"role": "assistant", "content": "hi", "extra": 1}])
    assert block_id(block) != block_id([{"role": "assistant", "content": "hi!"}])


# --- protocol_issues on mutated conversations --------------------------------


def _rules(issues) -> set[str]:
    return {issue.rule for issue in issues}


@given(conversations(min_blocks=1), st.data())
def test_removed_tool_result_is_an_unanswered_call(conv, data):
    prefix, parts = conv
    positions = _tool_positions(parts)
    assume(positions)
    bi, mi = data.draw(st.sampled_from(positions))
    missing_id = parts[bi][mi]["tool_call_id"]
    parts = copy.deepcopy(parts)
    del parts[bi][mi]
    issues = protocol_issues(join(prefix, parts))
    assert _rules(issues) == {"unanswered_tool_call"}
    assert len(issues) == 1
    assert issues[0].index == _offset(prefix, parts, bi)  # the assistant that made the call
    assert repr(missing_id) in issues[0].detail


@given(conversations(min_blocks=1), st.data())
def test_tool_result_with_unknown_id(conv, data):
    prefix, parts = conv
    bi = data.draw(st.integers(0, len(parts) - 1))
    pos = data.draw(st.integers(1, len(parts[bi])))  # anywhere after the assistant
    parts = copy.deepcopy(parts)
    parts[bi].insert(pos, {"role": "tool", "tool_call_id": UNKNOWN_ID, "content": "?"})
    issues = protocol_issues(join(prefix, parts))
    assert _rules(issues) == {"unknown_tool_call_id"}
    assert [i.index for i in issues] == [_offset(prefix, parts, bi) + pos]


@given(conversations(min_blocks=1), st.data())
def test_duplicated_tool_result(conv, data):
    prefix, parts = conv
    positions = _tool_positions(parts)
    assume(positions)
    bi, mi = data.draw(st.sampled_from(positions))
    pos = data.draw(st.integers(1, len(parts[bi])))
    parts = copy.deepcopy(parts)
    parts[bi].insert(pos, copy.deepcopy(parts[bi][mi]))
    # the second occurrence (in order) is the duplicate
    second = pos if pos > mi else mi + 1
    issues = protocol_issues(join(prefix, parts))
    assert _rules(issues) == {"duplicate_tool_result"}
    assert [i.index for i in issues] == [_offset(prefix, parts, bi) + second]


@given(conversations(), st.data())
def test_tool_result_before_any_assistant_is_an_orphan(conv, data):
    prefix, parts = conv
    pos = data.draw(st.integers(0, len(prefix)))
    call_id = data.draw(st.text(alphabet=ID_ALPHABET, min_size=1, max_size=4))
    prefix = prefix[:pos] + [{"role": "tool", "tool_call_id": call_id, "content": "x"}] + prefix[pos:]
    issues = protocol_issues(join(prefix, parts))
    assert _rules(issues) == {"orphan_tool_result"}
    assert [i.index for i in issues] == [pos]


def test_repeated_call_id_in_one_assistant_message():
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [call, dict(call)]},
        {"role": "tool", "tool_call_id": "a", "content": "r"},
    ]
    assert _rules(protocol_issues(messages)) == {"duplicate_tool_call_id"}


# --- check_message_shape -----------------------------------------------------


@given(valid_messages())
def test_check_message_shape_accepts_valid_conversations(messages):
    assert check_message_shape(messages) is messages


def test_check_message_shape_accepts_null_assistant_content():
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": None}]
    assert check_message_shape(messages) is messages


_CALL = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages",
    [
        pytest.param(None, id="none"),
        pytest.param({"role": "user", "content": "u"}, id="dict-not-list"),
        pytest.param("hello", id="string"),
        pytest.param([], id="empty-list"),
        pytest.param(["hello"], id="non-dict-message"),
        pytest.param([{"role": "robot", "content": "x"}], id="unknown-role"),
        pytest.param([{"content": "x"}], id="missing-role"),
        pytest.param(
            [{"role": "user", "content": "u"}, {"role": "tool", "content": "r"}], id="tool-without-tool_call_id"
        ),
        pytest.param([{"role": "tool", "content": "r", "tool_call_id": 7}], id="tool-with-non-string-tool_call_id"),
        pytest.param([{"role": "user", "content": "u", "tool_calls": [_CALL]}], id="tool_calls-on-user"),
        pytest.param([{"role": "assistant", "content": None, "tool_calls": _CALL}], id="tool_calls-not-a-list"),
        pytest.param(
            [{"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}], id="tool_call-without-function"
        ),
    ],
)
def test_check_message_shape_rejects(messages):
    with pytest.raises(MalformedRequest):
        check_message_shape(messages)


def test_malformed_request_is_a_value_error():
    assert issubclass(MalformedRequest, ValueError)


def test_a_block_repeated_word_for_word_has_an_id_of_its_own_that_stays():
    step = [{"role": "assistant", "content": "I will check."}, {"role": "user", "content": "ok"}]
    messages = [{"role": "user", "content": "task"}, *step, *step, *step]
    ids = [b.block_id for b in split_conversation(messages).blocks]
    assert len(set(ids)) == 3 and ids[0] == block_id(step)  # a first occurrence hashes its content alone
    longer = [b.block_id for b in split_conversation([*messages, *step]).blocks]
    assert longer[:3] == ids  # the agent resends the history: the ids of its blocks stay


def test_last_tool_is_the_newest_named_call():
    def call(name):
        return {"type": "function", "function": {"name": name, "arguments": "{}"}}

    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("search"), call("read")]},
        {"role": "tool", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [call(""), {"function": None}]},
        {"role": "tool", "content": "y"},
    ]
    assert last_tool(messages) == "read"  # calls without a name are passed over
    assert last_tool(messages[:1]) is None
    assert last_tool([*messages, {"role": "assistant", "tool_calls": [call("bash")]}]) == "bash"
