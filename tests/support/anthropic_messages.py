"""A recorded chat history as an Anthropic Messages client sends it: the
system prompt apart, ``tool_use`` blocks in the assistant's turn, each
``tool_result`` in a user turn (consecutive results and what the user says
after them in one turn, as the API asks)."""

from __future__ import annotations

import json
from typing import Any


def to_anthropic(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """(system, messages) of the Messages API for OpenAI-style ``messages``."""
    system = "\n".join(str(m.get("content") or "") for m in messages if m["role"] == "system")
    turns: list[dict[str, Any]] = []

    def add(role: str, block: dict[str, Any]) -> None:
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].append(block)
        else:
            turns.append({"role": role, "content": [block]})

    for message in messages:
        role, text = message["role"], str(message.get("content") or "")
        if role == "system":
            continue
        if role == "tool":
            add("user", {"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": text or " "})
        elif role == "assistant":
            if text:
                add("assistant", {"type": "text", "text": text})
            for call in message.get("tool_calls") or []:
                arguments = json.loads(call["function"]["arguments"] or "{}")
                add(
                    "assistant",
                    {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments},
                )
        elif text:
            add("user", {"type": "text", "text": text})
    return system, turns
