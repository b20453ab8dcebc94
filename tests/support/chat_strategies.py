"""Hypothesis strategies for valid OpenAI-style agent conversations.

A conversation is a prefix (optional system message(s), then the user task)
followed by blocks. A block is an assistant message (plain text, or content
None with 1-3 tool calls with unique ids) followed by exactly one tool result
per call, in any order, then optionally some user messages.

Call ids use the alphabet ``ID_ALPHABET`` only, so ``UNKNOWN_ID`` can never
collide with a generated id. Ids may repeat across blocks (the protocol only
asks for uniqueness within one assistant message).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

Message = dict[str, Any]

ID_ALPHABET = "abc0123"
UNKNOWN_ID = "zz_unknown"

short_text = st.text(max_size=12)
call_ids = st.text(alphabet=ID_ALPHABET, min_size=1, max_size=4)


@st.composite
def prefixes(draw) -> list[Message]:
    systems = draw(st.lists(short_text, max_size=2))
    prefix: list[Message] = [{"role": "system", "content": s} for s in systems]
    prefix.append({"role": "user", "content": draw(short_text)})
    return prefix


@st.composite
def blocks(draw) -> list[Message]:
    """One block: assistant message, its tool results (any order), user replies."""
    calls_tools = draw(st.booleans())
    messages: list[Message] = []
    if calls_tools:
        ids = draw(st.lists(call_ids, min_size=1, max_size=3, unique=True))
        calls = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": draw(st.sampled_from(["read", "ls", "grep"])), "arguments": draw(short_text)},
            }
            for call_id in ids
        ]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        for call_id in draw(st.permutations(ids)):
            messages.append({"role": "tool", "tool_call_id": call_id, "content": draw(short_text)})
    else:
        messages.append({"role": "assistant", "content": draw(short_text)})
    for text in draw(st.lists(short_text, max_size=2)):
        messages.append({"role": "user", "content": text})
    return messages


@st.composite
def conversations(draw, min_blocks: int = 0, max_blocks: int = 6) -> tuple[list[Message], list[list[Message]]]:
    """(prefix, [block messages, ...]); flatten with ``join``."""
    prefix = draw(prefixes())
    parts = draw(st.lists(blocks(), min_size=min_blocks, max_size=max_blocks))
    return prefix, parts


def join(prefix: list[Message], parts: list[list[Message]]) -> list[Message]:
    out = list(prefix)
    for block in parts:
        out.extend(block)
    return out


@st.composite
def valid_messages(draw, min_blocks: int = 0, max_blocks: int = 6) -> list[Message]:
    return join(*draw(conversations(min_blocks=min_blocks, max_blocks=max_blocks)))


def has_tool_result(parts: list[list[Message]]) -> bool:
    return any(m["role"] == "tool" for block in parts for m in block)
