"""The typed engine contract: everything a policy may ask of the serving engine.

The server implements it with the served model (``vllm_pamer/server/services.py``);
tests implement it with small deterministic stand-ins. Every member is
required, so a policy never probes for optional ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import numpy as np

from vllm_pamer.core.blocks import Message, Tool
from vllm_pamer.core.store import Memory


class EngineServices(Protocol):
    embedder_name: str
    """What ``embed`` writes (``core.recall.SERVED_STATE_EMBEDDER`` for the
    served model's own state); memories record it."""
    max_model_len: int
    """The served window in tokens: prompt and answer together."""

    def count_tokens(self, messages: Sequence[Message]) -> int:
        """Tokens of a span of a conversation (no generation prompt), as the
        served tokenizer counts them: budgets and gates."""
        ...

    def prompt_tokens(self, messages: Sequence[Message], tools: list[Tool] | None = None) -> int:
        """Prompt tokens of a whole request of these messages and tools, as the
        engine counts them: what must fit the window."""
        ...

    def summary_slot(self) -> AbstractAsyncContextManager[object]:
        """A turn to run a summary: the engine runs a few at once, server-wide,
        and the others wait (side by side on a KV cache that cannot hold their
        prefixes, every summary recomputes and all of them time out)."""
        ...

    async def summarize(self, source: str, max_tokens: int) -> str:
        """A summary of ``source`` (text) by the served model."""
        ...

    async def summarize_conversation(self, messages: Sequence[Message], max_tokens: int) -> str | None:
        """A summary request made of chat ``messages`` whose last turn is the
        instruction (its prefix is then a prefix-cache hit); None when they do
        not fit the window."""
        ...

    async def complete(
        self,
        messages: Sequence[Message],
        max_tokens: int,
        json_schema: dict[str, Any] | None = None,
        kind: str = "internal",
    ) -> str:
        """An internal chat request (greedy, thinking off); ``json_schema``
        constrains the answer."""
        ...

    async def embed(self, text: str) -> np.ndarray:
        """A float32 embedding of ``text`` (by ``embedder_name``)."""
        ...

    def kv_usage(self) -> float | None:
        """The engine's KV-cache usage (0-1) as it last reported it; None: unknown."""
        ...

    def kv_capacity(self) -> int | None:
        """Tokens the engine's KV cache holds (all engines together); None: unknown."""
        ...

    def sync_memories(self, session: str, memories: Sequence[Memory], held: Sequence[int] = ()) -> None:
        """Hand ``session``'s memories (those searched by state) to where the
        next capture searches them (the worker's rows), ``held`` the ids the
        last capture found there; returns at once, never raises: a failure only
        leaves the search to the API server (``core.recall.merge_recall``)."""
        ...
