"""Hand-made chat messages: a user turn, an assistant's text, an assistant's
tool call (arguments as JSON) and a tool result."""

from __future__ import annotations

import json


def user(text):
    return {"role": "user", "content": text}


def say(text):
    return {"role": "assistant", "content": text}


def call(call_id, name, **arguments):
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        ],
    }


def result(call_id, text):
    return {"role": "tool", "tool_call_id": call_id, "content": text}
