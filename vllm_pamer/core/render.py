"""Tool calls as text, for chat templates that know no tools (SmolLM2's).

Such a template concatenates ``role`` and ``content`` only: an assistant
message that just calls tools would render as nothing (or fail on a null
content). We write each call into the assistant's text and keep tool results
as ``tool`` messages with a one-line header naming the call they answer.
Templates with tool support get the messages unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vllm_pamer.core.blocks import Message


def template_supports_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tool_calls" in chat_template


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # content parts: keep the text ones
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _arguments(arguments: Any) -> Any:
    """JSON arguments as an object, so the text reads as the hermes format
    (``{"name": ..., "arguments": {...}}``) that vLLM's parser turns back into
    tool calls; anything else as it came."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def render_tools_as_text(messages: Sequence[Message]) -> list[Message]:
    rendered: list[Message] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                "<tool_call>"
                + json.dumps(
                    {"name": call["function"].get("name"), "arguments": _arguments(call["function"].get("arguments"))},
                    ensure_ascii=False,
                )
                + "</tool_call>"
                for call in message["tool_calls"]
            ]
            text = "\n".join([t for t in [_text(message.get("content"))] if t] + calls)
            rendered.append({"role": "assistant", "content": text})
        elif role == "tool":
            name = message.get("name") or "tool"
            header = f"[{name} result for call {message.get('tool_call_id')}]"
            rendered.append(
                {
                    "role": "tool",
                    "content": f"{header}\n{_text(message.get('content'))}",
                    "tool_call_id": message.get("tool_call_id"),
                }
            )
        elif message.get("content") is None:
            rendered.append({**message, "content": ""})
        else:
            rendered.append(message)
    return rendered
