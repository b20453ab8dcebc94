"""Test doubles shared by the policy tests: a deterministic engine that keeps
the whole engine contract (``core/engine.py``), head votes, the conversations
the policy tests build, and blocking calls into the (async) memory store."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any

import numpy as np

from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.core.policies import HeadVote

COMPRESS = HeadVote((5.0,) * 5, 5, True)
KEEP = HeadVote((-5.0,) * 5, 0, False)


class FakeEngine:
    """Bag-of-words embeddings, 4 characters a token, a summary that lists
    the ``ID..`` words of its source; ``complete`` answers like a SAM cue;
    the window is unknown (0: PaMER's window guard off) unless set; the
    request's tools count 50 tokens each; summaries run ``slots`` at a time
    (None: any number)."""

    embedder_name = "bag-of-words"
    max_model_len = 0

    def __init__(
        self,
        summary_error=None,
        embed_error=None,
        summary_delay=0.0,
        window: int | None = None,
        kv_usage: float | None = None,
        slots: int | None = None,
        kv_capacity: int | None = None,
    ):
        self.summary_error, self.embed_error, self.summary_delay = summary_error, embed_error, summary_delay
        if window is not None:
            self.max_model_len = window
        self.kv, self.capacity = kv_usage, kv_capacity
        self.summaries = 0
        self.running = self.most_running = 0  # summaries in progress, and the most at once
        self._slots = asyncio.Semaphore(slots) if slots else contextlib.nullcontext()
        self.counted: list[int] = []  # messages of every prompt_tokens call
        self.conversation_summaries = 0  # summary requests in the conversation layout
        self.synced: dict[str, list[int]] = {}  # session -> memory ids last handed to sync_memories

    def kv_usage(self):
        return self.kv

    def kv_capacity(self):
        return self.capacity

    def count_tokens(self, messages):
        return sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in messages) // 4

    def prompt_tokens(self, messages, tools=None):
        self.counted.append(len(messages))
        return self.count_tokens(messages) + 50 * len(tools or [])

    def summary_slot(self):
        return self._slots

    async def summarize(self, source, max_tokens):
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(self.summary_delay)
        finally:
            self.running -= 1
        if self.summary_error:
            raise self.summary_error
        self.summaries += 1
        return "SUMMARY " + " ".join(sorted(set(w for w in source.split() if w.startswith("ID"))))

    async def summarize_conversation(self, messages, max_tokens):
        self.conversation_summaries += 1
        return None  # "does not fit": the text layout is used

    async def complete(self, messages, max_tokens, json_schema=None, kind="internal"):
        ids = sorted({w for w in messages[-1]["content"].split() if w.startswith("ID")})
        return f"{kind}: " + " ".join(ids)

    async def embed(self, text):
        if self.embed_error:
            raise self.embed_error
        vector = np.zeros(64, dtype=np.float32)
        for word in text.split():
            vector[int(hashlib.md5(word.encode()).hexdigest(), 16) % 64] += 1
        return vector

    def sync_memories(self, session, memories, held=()):
        self.synced[session] = [m.id for m in memories]


def conversation(n_blocks: int, chars: int = 900) -> list[dict]:
    """System + task, then ``n_blocks`` blocks: a lookup call and its result ``IDi xxx...``."""
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Task: fix ID-task"}]
    for i in range(n_blocks):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": f'{{"k": "ID{i}"}}'}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"ID{i} " + "x" * chars})
    return messages


def lookup_chat(n_blocks: int, chars: int = 400) -> list[dict]:
    """System + task, then ``n_blocks`` blocks: a call and its result ``IDi xxx...``
    (named, as the baseline policies' tests stub it)."""
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Task"}]
    for i in range(n_blocks):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": f'{{"k": {i}}}'}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "name": "lookup", "content": f"ID{i} " + "x" * chars})
    return messages


def blocks_of(messages: list[dict], start: int, stop: int | None = None) -> list[dict]:
    """The messages of blocks ``start:stop`` of ``messages``."""
    return [m for b in split_conversation(messages).blocks[start:stop] for m in b.messages]


def mixed_conversation(n_blocks: int) -> tuple[list[dict], list[list[dict]]]:
    """(prefix, blocks): system + task, then ``n_blocks`` blocks that alternate
    tool-calling assistants (two calls, answered in reverse order) and plain-text ones."""
    prefix = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    parts = []
    for b in range(n_blocks):
        if b % 2 == 0:
            ids = [f"c{b}a", f"c{b}b"]
            calls = [{"id": i, "type": "function", "function": {"name": "read", "arguments": '{"p": 1}'}} for i in ids]
            parts.append(
                [
                    {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "tool", "tool_call_id": ids[1], "content": f"r{b}b"},
                    {"role": "tool", "tool_call_id": ids[0], "content": f"r{b}a"},
                ]
            )
        else:
            parts.append([{"role": "assistant", "content": f"thinking {b}"}, {"role": "user", "content": f"go {b}"}])
    return prefix, parts


def same_objects(a: list, b: list) -> bool:
    """The same message objects, in the same order (not copies)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class blocking:  # noqa: N801 - reads as a function: blocking(store).load("s1")
    """The store's coroutines called from synchronous test code."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        return lambda *args, **kwargs: asyncio.run(method(*args, **kwargs))


class Sink:
    """Stands in for the worker's capture publisher: keeps what it is handed."""

    def __init__(self):
        self.records = []

    def publish(self, record):
        self.records.append(record)
