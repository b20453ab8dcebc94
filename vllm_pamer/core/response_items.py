"""A chat view as the ``instructions`` and ``input`` items of an OpenAI
Responses request (``server/responses.py`` sends a rewritten view this way;
the replay speaks the Responses API with it). Pure: no vLLM import."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_pamer.core.blocks import Message


def _item_content(content: Any, role: str) -> Any:
    """Chat content as a Responses message's content (the way back of ``_chat_content``)."""
    if not isinstance(content, list):
        return content if content is not None else ""
    text_type = "output_text" if role == "assistant" else "input_text"
    parts: list[dict[str, Any]] = []
    for part in content:
        if part.get("type") == "text":
            parts.append({"type": text_type, "text": part.get("text", "")})
        elif part.get("type") == "image_url":
            url = (part.get("image_url") or {}).get("url", "")
            parts.append({"type": "input_image", "image_url": url, "detail": "auto"})
        else:
            parts.append(part)
    return parts


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def response_items(messages: Sequence[Message]) -> tuple[str | None, list[dict[str, Any]]]:
    """Chat messages as the ``instructions`` and ``input`` of a Responses body
    that vLLM reads back as the same messages: a first system message with
    text as ``instructions``; an assistant's reasoning, text and tool calls as
    a ``reasoning`` item, a message and ``function_call`` items (vLLM joins
    them into one message again, and joins them to an assistant message right
    before them that has no calls: nothing is lost or reordered); a tool
    message as a ``function_call_output``; every other message a message."""
    instructions = None
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        instructions, messages = messages[0]["content"], messages[1:]
    items: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = str(message.get("role"))
        if role == "tool":
            output = message.get("content")
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message.get("tool_call_id"),
                    "output": output if isinstance(output, str) else _text(output),
                }
            )
            continue
        if role != "assistant":
            items.append({"role": role, "content": _item_content(message.get("content"), role)})
            continue
        if message.get("reasoning"):
            text = {"type": "reasoning_text", "text": message["reasoning"]}
            items.append({"type": "reasoning", "id": f"rs_{index}", "summary": [], "content": [text]})
        content = message.get("content")
        if content or not message.get("tool_calls"):
            items.append({"role": "assistant", "content": _text(content)})
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            items.append(
                {
                    "type": "function_call",
                    "call_id": call.get("id"),
                    "name": function.get("name"),
                    "arguments": function.get("arguments") or "",
                }
            )
    return instructions, items
