"""Tool calls rendered as text for templates without tool support (``core/render.py``)."""

from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import given

from tests.support.chat_strategies import valid_messages
from vllm_pamer.core.render import render_tools_as_text, template_supports_tools

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _as_object(arguments):
    try:
        parsed = json.loads(arguments)
    except (TypeError, ValueError):
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def _call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_assistant_tool_calls_become_text():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("c1", "read_file", '{"path": "a.py"}'), _call("c2", "ls", "dir=src")],
    }
    [out] = render_tools_as_text([message])
    assert out["role"] == "assistant"
    assert "tool_calls" not in out
    text = out["content"]
    assert isinstance(text, str)
    assert "read_file" in text and "ls" in text and "dir=src" in text
    calls = [json.loads(body) for body in TOOL_CALL.findall(text)]
    assert calls == [
        {"name": "read_file", "arguments": {"path": "a.py"}},  # JSON arguments as an object (hermes)
        {"name": "ls", "arguments": "dir=src"},
    ]
    assert text.startswith("<tool_call>")  # no empty line for the null content


def test_assistant_text_is_kept_before_the_calls():
    message = {"role": "assistant", "content": "Let me look.", "tool_calls": [_call("c1", "grep", "x")]}
    [out] = render_tools_as_text([message])
    first, rest = out["content"].split("\n", 1)
    assert first == "Let me look."
    assert json.loads(TOOL_CALL.findall(rest)[0]) == {"name": "grep", "arguments": "x"}


def test_assistant_content_parts_keep_their_text():
    message = {
        "role": "assistant",
        "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}],
        "tool_calls": [_call("c1", "grep", "x")],
    }
    [out] = render_tools_as_text([message])
    assert out["content"].split("\n")[0] == "ab"


def test_tool_message_gets_a_header_naming_the_call():
    messages = [
        {"role": "tool", "tool_call_id": "call_42", "content": "file contents"},
        {"role": "tool", "tool_call_id": "call_43", "name": "read_file", "content": None},
    ]
    first, second = render_tools_as_text(messages)
    header, body = first["content"].split("\n", 1)
    assert "call_42" in header
    assert body == "file contents"
    assert first["role"] == "tool" and first["tool_call_id"] == "call_42"
    header, body = second["content"].split("\n", 1)
    assert "call_43" in header and "read_file" in header
    assert body == ""


@pytest.mark.parametrize("role", ["assistant", "user", "system"])
def test_null_content_becomes_empty_string(role):
    message = {"role": role, "content": None}
    [out] = render_tools_as_text([message])
    assert out["content"] == ""
    assert out["role"] == role
    assert message["content"] is None  # input untouched


def test_other_messages_pass_unchanged():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    out = render_tools_as_text(messages)
    assert all(a is b for a, b in zip(out, messages)) and len(out) == len(messages)


@given(valid_messages())
def test_render_property(messages):
    snapshot = copy.deepcopy(messages)
    out = render_tools_as_text(messages)
    assert messages == snapshot  # never mutates the request
    assert [m["role"] for m in out] == [m["role"] for m in messages]
    for original, rendered in zip(messages, out):
        assert "tool_calls" not in rendered
        assert isinstance(rendered["content"], str)
        if original.get("tool_calls"):
            found = [json.loads(body) for body in TOOL_CALL.findall(rendered["content"])]
            want = [
                {"name": c["function"]["name"], "arguments": _as_object(c["function"]["arguments"])}
                for c in original["tool_calls"]
            ]
            assert found == want
        if original["role"] == "tool":
            assert original["tool_call_id"] in rendered["content"].split("\n", 1)[0]
            assert rendered["content"].split("\n", 1)[1] == original["content"]


@pytest.mark.parametrize(
    "template, expected",
    [
        ("{% for m in messages %}{% if m.tool_calls %}...{% endif %}{% endfor %}", True),
        ("{% if message['tool_calls'] %}x{% endif %}", True),
        ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}", False),
        (None, False),
        ("", False),
    ],
)
def test_template_supports_tools(template, expected):
    assert template_supports_tools(template) is expected
