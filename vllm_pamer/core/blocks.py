"""Chat blocks: how a request's messages split into prefix, blocks and recent.

Pure Python, no vLLM import. Definitions (PaMER paper, §3; docs/design.md):

* **Prefix P** - every message before the first assistant message (the system
  message(s) and the task).
* **Block** - one assistant message plus every following non-assistant message
  up to the next assistant message (its tool results, user replies). Working on
  whole blocks keeps every tool call next to its tool result.
* **Recent R** - the ``n_recent`` most recent blocks; **old O** - the blocks
  between P and R.

``split_conversation`` and ``Conversation.messages()`` are exact inverses: a
split re-joins to the very same list of message objects.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import msgspec

Message = dict[str, Any]
Tool = dict[str, Any]
"""One entry of a request's ``tools`` (an OpenAI function tool)."""

KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class MalformedRequest(ValueError):
    """The request is not a well-formed chat: answered with HTTP 400."""


class ProtocolIssue(msgspec.Struct, frozen=True):
    """One violation of the tool-call protocol (the request itself is well formed)."""

    index: int
    """Position of the offending message in the request."""
    rule: str
    """Short machine name: orphan_tool_result, unknown_tool_call_id,
    duplicate_tool_result, unanswered_tool_call, duplicate_tool_call_id."""
    detail: str


class Block(msgspec.Struct, frozen=True):
    """An assistant message and the non-assistant messages that follow it."""

    messages: tuple[Message, ...]
    occurrence: int = 0
    """Earlier blocks of its conversation with the same content (an agent, or
    a model's own short answers, may repeat a step word for word): the id
    tells them apart, so each is archived once."""

    @property
    def assistant(self) -> Message:
        return self.messages[0]

    @property
    def block_id(self) -> str:
        return block_id(self.messages, self.occurrence)

    def tool_call_ids(self) -> list[str]:
        return [call.get("id", "") for call in self.assistant.get("tool_calls") or []]


class Conversation(msgspec.Struct, frozen=True):
    """A request's messages split into the prefix and whole blocks."""

    prefix: tuple[Message, ...]
    blocks: tuple[Block, ...]

    def messages(self) -> list[Message]:
        out = list(self.prefix)
        for block in self.blocks:
            out.extend(block.messages)
        return out

    def old_and_recent(self, n_recent: int = 2) -> tuple[tuple[Block, ...], tuple[Block, ...]]:
        """(O, R) of all the blocks (``split_recent``); policies split C_eff
        instead (``core/view.py``)."""
        return split_recent(self.blocks, n_recent)


def split_recent(blocks: Sequence[Block], n_recent: int) -> tuple[tuple[Block, ...], tuple[Block, ...]]:
    """(O, R): R is the ``n_recent`` most recent blocks (none for 0), O the blocks before them."""
    cut = max(0, len(blocks) - max(0, n_recent))
    return tuple(blocks[:cut]), tuple(blocks[cut:])


def last_tool(messages: Sequence[Message]) -> str | None:
    """The name of the last tool ``messages`` call (None: none called). The
    metadata control (``policies/pamer/control_vote.py``) reads it of a request,
    the annotator (``training/annotate.py``) of each decision point: one rule."""
    for message in reversed(messages):
        for call in reversed(message.get("tool_calls") or []):
            name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
            if name:
                return str(name)
    return None


def check_message_shape(messages: Any) -> list[Message]:
    """Raise MalformedRequest unless ``messages`` is a non-empty list of chat
    messages with known roles. Content may be a string, a list of parts or null
    (an assistant message that only calls tools)."""
    if not isinstance(messages, list) or not messages:
        raise MalformedRequest("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise MalformedRequest(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in KNOWN_ROLES:
            raise MalformedRequest(f"messages[{i}].role {role!r} is not a chat role")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise MalformedRequest(f"messages[{i}].tool_calls must be a list on an assistant message")
            for j, call in enumerate(calls):
                if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
                    raise MalformedRequest(f"messages[{i}].tool_calls[{j}] has no function")
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise MalformedRequest(f"messages[{i}] is a tool result without tool_call_id")
    return messages


def split_conversation(messages: Sequence[Message]) -> Conversation:
    """Split messages into prefix and blocks (lossless; no protocol check)."""
    first_assistant = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    grouped: list[tuple[Message, ...]] = []
    current: list[Message] = []
    for message in messages[first_assistant:]:
        if message.get("role") == "assistant" and current:
            grouped.append(tuple(current))
            current = []
        current.append(message)
    if current:
        grouped.append(tuple(current))
    seen: dict[str, int] = {}  # content id -> blocks so far with that content
    blocks = []
    for group in grouped:
        content = block_id(group)
        blocks.append(Block(group, seen.get(content, 0)))
        seen[content] = seen.get(content, 0) + 1
    return Conversation(prefix=tuple(messages[:first_assistant]), blocks=tuple(blocks))


def protocol_issues(messages: Sequence[Message]) -> list[ProtocolIssue]:
    """Every tool result must answer a call of the assistant message that opens
    its block, once; every call must be answered before the next assistant
    message. An empty list means the protocol is safe to rewrite."""
    issues: list[ProtocolIssue] = []
    open_calls: dict[str, int] | None = None  # call id -> index of the assistant message
    answered: set[str] = set()

    def close_block(at: int) -> None:
        for call_id, where in (open_calls or {}).items():
            if call_id not in answered:
                issues.append(
                    ProtocolIssue(where, "unanswered_tool_call", f"call {call_id!r} has no result before message {at}")
                )

    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            close_block(i)
            open_calls, answered = {}, set()
            for call in message.get("tool_calls") or []:
                call_id = call.get("id")
                if not call_id or call_id in open_calls:
                    issues.append(
                        ProtocolIssue(i, "duplicate_tool_call_id", f"call id {call_id!r} is empty or repeated")
                    )
                open_calls[call_id] = i
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if open_calls is None:
                issues.append(ProtocolIssue(i, "orphan_tool_result", "tool result before any assistant message"))
            elif call_id not in open_calls:
                issues.append(
                    ProtocolIssue(i, "unknown_tool_call_id", f"no call {call_id!r} in the preceding assistant message")
                )
            elif call_id in answered:
                issues.append(ProtocolIssue(i, "duplicate_tool_result", f"call {call_id!r} answered twice"))
            else:
                answered.add(call_id)
    close_block(len(messages))
    return issues


def _canonical(message: Message) -> dict[str, Any]:
    """The protocol content of a message: what identifies it across requests."""
    calls = [
        {
            "id": call.get("id"),
            "name": call.get("function", {}).get("name"),
            "arguments": call.get("function", {}).get("arguments"),
        }
        for call in message.get("tool_calls") or []
    ]
    return {
        "role": message.get("role"),
        "content": message.get("content"),
        "tool_calls": calls,
        "tool_call_id": message.get("tool_call_id"),
        "name": message.get("name"),
    }


def block_id(messages: Sequence[Message], occurrence: int = 0) -> str:
    """Stable hash of a block's protocol content and its ``occurrence`` (the
    agent resends the same history on every request, so this identifies a
    block across requests; a first occurrence hashes its content alone)."""
    payload = json.dumps([_canonical(m) for m in messages], sort_keys=True, ensure_ascii=False)
    if occurrence:
        payload += f"#{occurrence}"
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
