"""Plain-text views of chat messages: summary sources, recall queries, prompts."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_pamer.core.blocks import Message


def serialize_messages(messages: Sequence[Message]) -> str:
    """One line per message text and per tool call: ``role: text`` and
    ``role calls name(arguments)``."""
    lines = []
    for message in messages:
        role = message.get("role", "?")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if content:
            lines.append(f"{role}: {content}")
        for call in message.get("tool_calls") or []:
            function = call.get("function", {})
            lines.append(f"{role} calls {function.get('name')}({function.get('arguments')})")
    return "\n".join(lines)


def char_tokens(messages: Sequence[Message]) -> int:
    """Characters of the plain-text view // 4: a token count with no tokenizer
    (the annotator's ``--tokens chars``, the metadata control's lengths)."""
    return len(serialize_messages(messages)) // 4


HISTORY_GAP = "\n[... middle of the history omitted ...]\n"


def cap_head_and_tail(text: str, budget: int, marker: str = HISTORY_GAP) -> str:
    """Keep the beginning and the end of ``text`` within ``budget`` characters,
    ``marker`` where the middle was."""
    if len(text) <= budget:
        return text
    keep = max(0, budget - len(marker))
    return text[: keep // 2] + marker + text[len(text) - (keep - keep // 2) :]
