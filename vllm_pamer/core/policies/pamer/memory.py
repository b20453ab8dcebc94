"""Writing a PaMER memory, for both schedules: the summary
(``summary_writer.py``) and its embedding, the query recall searches with,
and the memory text the budget schedule shows, for each kind of memory its
compactions can write (``MemoryKind``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec
import numpy as np

from vllm_pamer.core.blocks import Block, Message
from vllm_pamer.core.engine import EngineServices
from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.policies.base import PolicyRequest
from vllm_pamer.core.policies.baselines import TOOL_ROLES, masked
from vllm_pamer.core.policies.pamer.config import PamerOptions
from vllm_pamer.core.policies.pamer.record import RECORD_HEADER
from vllm_pamer.core.policies.summary_writer import StepFailure, memory_message, summary_instruction, write_summary
from vllm_pamer.core.recall import SERVED_STATE_EMBEDDER
from vllm_pamer.core.retry import with_retries
from vllm_pamer.core.store import Memory, MemoryStore
from vllm_pamer.core.view import flatten


class MemoryWriter:
    """A memory's text and embedding, with the config's layout and retries."""

    def __init__(self, config: PamerOptions) -> None:
        self.config = config

    async def summarize(
        self,
        blocks: Sequence[Block],
        services: EngineServices,
        prefix: Sequence[Message] | None = None,
        shown: Sequence[Message] = (),
    ) -> str:
        """``prefix`` (P) and ``shown`` (the memory messages the previous
        request showed) rebuild what the engine saw before ``blocks``, for the
        conversation layout; without ``prefix`` the text layout is used."""
        cfg = self.config
        conversation = None
        if cfg.summary_layout == "conversation" and prefix is not None:
            seen = list(prefix) + list(shown)
            conversation = seen + flatten(blocks) + [summary_instruction(after_memories=bool(shown))]
        return await write_summary(services, cfg, blocks, conversation)

    async def summarize_and_embed(
        self,
        blocks: Sequence[Block],
        services: EngineServices,
        prefix: Sequence[Message] | None = None,
        shown: Sequence[Memory] = (),
    ) -> tuple[str, np.ndarray]:
        """The summary (``summarize``, ``shown`` as one memory message) and its embedding."""
        summary = await self.summarize(blocks, services, prefix, [memory_message(shown)] if shown else [])
        return summary, await self.embed(summary, services)

    async def embed(self, text: str, services: EngineServices, state: np.ndarray | None = None) -> np.ndarray:
        """A memory's embedding: ``state`` (the served model's, captured at the
        session's previous prompt, which costs no request) when given and the
        memories live in that space, else ``text`` embedded."""
        if state is not None and services.embedder_name == SERVED_STATE_EMBEDDER:
            return np.asarray(state, dtype=np.float32)
        cfg = self.config
        try:
            return await with_retries(
                lambda: services.embed(text), cfg.embed_timeout_s, cfg.embed_attempts, "memory embedding"
            )
        except Exception as exc:
            raise StepFailure(Fallback.EMBEDDING_FAILURE, str(exc)) from exc


def captured_query(
    cfg: PamerOptions, request: PolicyRequest, services: EngineServices, memories: list[Memory]
) -> np.ndarray | None:
    """The deferred query (``query_source="captured"``) when it can stand in
    for the text query: a state was captured and it lives in the space the
    memories were embedded in (the served model's, same width)."""
    state = request.previous_state
    if cfg.query_source != "captured" or state is None:
        return None
    if services.embedder_name != SERVED_STATE_EMBEDDER:
        return None
    widths = {len(m.embedding) for m in memories if m.embedder == SERVED_STATE_EMBEDDER}
    return np.asarray(state, dtype=np.float32) if widths == {len(state)} else None


def shown_message(memories: Sequence[Memory], newest_whole: bool = True) -> Message:
    """The budget schedule's memory message: the newest memory's text whole
    (its record covers every archived step), older ones by their summaries.
    ``newest_whole`` False: the newest by its record alone, so a summary added
    to it after its compaction (``summary_after.py``) changes nothing shown."""
    newest = max((m.id for m in memories), default=0)

    def text(memory: Memory) -> str:
        if memory.id != newest:
            return summary_part(memory)
        return stored_turns(memory).text if newest_whole else record_part(memory)

    return memory_message([msgspec.structs.replace(m, summary=text(m)) for m in memories])


def summary_part(memory: Memory) -> str:
    """A memory's text without its verbatim record (empty for a record alone)."""
    text = stored_turns(memory).text
    return "" if text.startswith(RECORD_HEADER) else text.split("\n\n" + RECORD_HEADER, 1)[0]


def record_part(memory: Memory) -> str:
    """A memory's verbatim record (its whole text when it has none)."""
    text = stored_turns(memory).text
    if text.startswith(RECORD_HEADER):
        return text
    _, found, record = text.partition("\n\n" + RECORD_HEADER)
    return RECORD_HEADER + record if found else text


def with_summary(memory: Memory, summary: str) -> str:
    """The stored text of ``memory`` (a record alone, with or without turns)
    with ``summary`` put before its record."""
    stored = stored_turns(memory)
    text = f"{summary}\n\n{stored.text}"
    return turns_text(text, stored.turns) if memory.summary.startswith('{"text":') else text


MemoryKind = Literal["summary", "record", "none", "masked", "excerpts", "turns", "summary_turns"]
"""What replaces the blocks a budget-schedule compaction archives: ``summary``
(PaMER: a summary and the verbatim record), ``record`` (the record alone, no
summary request), ``none`` (nothing: truncation), ``masked`` (the blocks
themselves with their tool outputs replaced by a placeholder: observation
masking in the schedule's large, rare steps), ``excerpts`` (the same, each
placeholder followed by the lines of that output the record would keep),
``turns`` and ``summary_turns`` (``record`` and ``summary`` followed by the
newest archived blocks with their tool outputs masked: the agent's own turns
as it wrote them, the old outputs' lines in the record; ``turns_share``; a
``summary_turns`` memory is recalled as a ``summary`` one is, by its summary)."""

TURN_KINDS: frozenset[MemoryKind] = frozenset({"turns", "summary_turns"})
"""The kinds whose memory shows archived turns after its text."""

SUMMARY_KINDS: frozenset[MemoryKind] = frozenset({"summary", "summary_turns"})
"""The kinds whose memory has a summary before its record (an engine request)."""


def with_turns(kind: MemoryKind, turns_share: float) -> MemoryKind:
    """The kind a memory with a record is, given ``turns_share`` (0: as it is)."""
    if turns_share > 0 and kind == "summary":
        return "summary_turns"
    if turns_share > 0 and kind == "record":
        return "turns"
    return kind


MASKED_KINDS: frozenset[MemoryKind] = frozenset({"masked", "excerpts"})
"""The kinds whose memory is the archived blocks themselves, outputs masked: a
history shown newest first within its share, measured in tokens."""

NEWEST_ALONE: frozenset[MemoryKind] = frozenset({"record", "turns"})
"""The kinds whose newest memory covers every archived step: it alone is shown."""

UNSHOWN_EMBEDDERS: dict[MemoryKind, str] = {
    "none": "truncated",
    "masked": "masked",
    "excerpts": "masked-excerpts",
    "record": "record-only",
    "turns": "record-turns",
}
"""The embedder names of memories no recall searches (their embedding is
``NO_EMBEDDING``: a record alone shows only its newest, so none is ever
chosen by similarity); a session's memories of one kind never mix with another's."""


def kind_embedder(kind: MemoryKind, services: EngineServices) -> str:
    """The embedder name a compaction of ``kind`` stores its memory under."""
    return UNSHOWN_EMBEDDERS.get(kind, services.embedder_name)


def shown_messages(kind: MemoryKind, memories: Sequence[Memory], newest_whole: bool = True) -> list[Message]:
    """What a request shows for ``memories`` (already chosen) after its prefix
    (``newest_whole``: as in ``shown_message``)."""
    if not memories or kind == "none":
        return []
    if kind in MASKED_KINDS:  # messages, as JSON
        ordered = sorted(memories, key=lambda m: m.id)
        return [message for m in ordered for message in msgspec.json.decode(m.summary)]
    if kind in TURN_KINDS:  # the memory message (older summaries too, if chosen), then the newest's turns
        newest = max(memories, key=lambda m: m.id)
        return [shown_message(memories, newest_whole), *stored_turns(newest).turns]
    return [shown_message(memories, newest_whole)]


EXCERPT_MARK = "\nkept lines:\n"
"""Between a masked output's placeholder and the lines of it kept (``excerpts``)."""


def masked_text(blocks: Sequence[Block], excerpts: Mapping[tuple[int, int], str] | None = None) -> str:
    """A masked memory's text: its blocks' messages, tool outputs masked, as
    JSON; ``excerpts`` (``record.result_excerpts``): lines kept after an
    output's placeholder, by (block index, message index)."""
    messages: list[Message] = []
    for i, block in enumerate(blocks):
        for j, message in enumerate(masked(block.messages)[0]):
            kept = (excerpts or {}).get((i, j))
            if kept and message.get("role") in TOOL_ROLES:
                message = {**message, "content": f"{message['content']}{EXCERPT_MARK}{kept}"}
            messages.append(message)
    return msgspec.json.encode(messages).decode()


class TurnsMemory(msgspec.Struct):
    """A memory of a kind in ``TURN_KINDS``, as stored (JSON)."""

    text: str
    """The summary and the record, or the record alone."""
    turns: list[Message]
    """The newest archived blocks' messages, tool outputs masked."""


def turn_messages(turns: Sequence[Block]) -> list[Message]:
    """``turns`` as a memory shows them: whole blocks (a call keeps its
    result), tool outputs masked (the record may keep lines of them)."""
    return masked(flatten(turns))[0]


def turns_text(text: str, turns: Sequence[Message]) -> str:
    """A memory with turns (``turn_messages``), to store."""
    return msgspec.json.encode(TurnsMemory(text, list(turns))).decode()


_TURNS_DECODER = msgspec.json.Decoder(TurnsMemory)


def stored_turns(memory: Memory) -> TurnsMemory:
    """A memory's text and turns as stored: a memory of another kind (a
    session's older summaries, written before ``turns_share`` was set) is its
    text with no turns."""
    if memory.summary.startswith('{"text":'):
        try:
            return _TURNS_DECODER.decode(memory.summary)
        except msgspec.DecodeError:
            pass  # a summary that happens to start so: plain text
    return TurnsMemory(memory.summary, [])


async def archived_blocks(store: MemoryStore, session: str, memories: Sequence[Memory]) -> list[Block]:
    """The raw blocks ``memories`` archived, oldest first, for their content
    (a repeated block's ``occurrence`` is not kept: read the ids from the
    memories). StoreError when they cannot be read."""
    ids = [b for m in sorted(memories, key=lambda m: m.id) for b in m.covered_block_ids]
    raw = await store.raw_blocks(session, ids) if ids else {}
    return [Block(tuple(raw[b])) for b in ids if b in raw]
