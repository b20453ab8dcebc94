"""The engine contract (``core/engine.py``) served by the running vLLM engine:

* ``summarize`` - an internal chat request (temperature 0, thinking off where
  the template has the switch) whose source is trimmed from the middle until
  the prompt fits the model window; ``summarize_conversation`` - the same for
  chat messages rendered as the server renders an agent's request (so their
  prefix can come from the prefix cache);
* ``embed`` - the served model's own final-norm state at the last token of the
  text: a one-token internal request tagged with a capture key, its state
  read from the capture channel (no second model);
* ``count_tokens`` / ``prompt_tokens`` - the served tokenizer (``core/tokens.py``);
* ``sync_memories`` - a session's memory rows pushed to the worker, where
  the capture searches them (``worker/memory.py``), through vLLM's
  ``collective_rpc`` to the plugin's worker extension.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_pamer.adapters.serving import (
    call_workers,
    internal_sampling_params,
    kv_cache_usage,
    kv_capacity_tokens,
    worker_extension,
)
from vllm_pamer.channel import CAPTURE_KEY, SESSION_KEY, WORKER_EXTENSION, CaptureInbox
from vllm_pamer.core.blocks import Message
from vllm_pamer.core.policies.summary_writer import summary_prompt
from vllm_pamer.core.recall import SERVED_STATE_EMBEDDER
from vllm_pamer.core.store import Memory
from vllm_pamer.core.text import cap_head_and_tail
from vllm_pamer.core.tokens import TokenCounter
from vllm_pamer.embedders import Embedder
from vllm_pamer.server import metrics

logger = logging.getLogger("vllm_pamer.services")
RPC_TIMEOUT_S = 10.0
REPUSH_AFTER_S = 30.0
"""A session's memory set pushed this long ago and still not held by the
worker at a capture is pushed again (the worker evicted it, or the push failed)."""


class VllmEngineServices:
    def __init__(
        self,
        engine_client: Any,
        counter: TokenCounter,
        inbox: CaptureInbox,
        max_model_len: int,
        capture_wait_s: float,
        summary_concurrency: int,
        embedder: Embedder | None = None,
    ) -> None:
        """``embedder``: used instead of the served model's state (None: the
        served model). ``capture_wait_s``: how long an embedding waits for its
        capture record; ``summary_concurrency``: summaries at once (both the
        settings' fields)."""
        self.engine_client = engine_client
        self.counter = counter
        self.inbox = inbox
        self.max_model_len = max_model_len
        self.capture_wait_s = capture_wait_s
        self.embedder = embedder
        self._summary_slots = asyncio.Semaphore(summary_concurrency)
        self.embedder_name = embedder.name if embedder is not None else SERVED_STATE_EMBEDDER
        # recall in the worker needs its extension and the served model's state as the embedding
        self.worker_memory = WORKER_EXTENSION in worker_extension(engine_client) and embedder is None
        self._pushed: dict[str, tuple[tuple[int, ...], float]] = {}  # session -> (ids, when) last pushed from here
        self._rpcs: set[asyncio.Task] = set()
        self._kv: tuple[float, float | None] = (0.0, None)  # (when read, value)

    # -- token counts ------------------------------------------------------------
    def count_tokens(self, messages: Sequence[Message]) -> int:
        return self.counter.span(messages)

    def prompt_tokens(self, messages: Sequence[Message], tools: list[dict] | None = None) -> int:
        try:
            return self.counter.request(messages, tools)
        except Exception:  # a template that refuses these tools or messages: the span is the best bound
            return self.counter.span(messages)

    # -- internal requests ---------------------------------------------------------
    async def _run(self, prompt_ids: list[int], params: Any, kind: str) -> str:
        request_id = f"pamer-{kind}-{uuid.uuid4().hex}"
        text, generated = "", 0
        async for output in self.engine_client.generate({"prompt_token_ids": prompt_ids}, params, request_id):
            if output.outputs:
                text = output.outputs[0].text
                generated = len(output.outputs[0].token_ids)
        # the plugin's own tokens count in a policy's total (PaMER paper eq. 45)
        metrics.INTERNAL_PROMPT_TOKENS.labels(kind).inc(len(prompt_ids))
        metrics.INTERNAL_COMPLETION_TOKENS.labels(kind).inc(generated)
        return text

    def _answer_budget(self, max_tokens: int) -> tuple[int, int]:
        """(answer tokens, prompt tokens that fit beside them): an internal
        answer takes at most a quarter of the window."""
        max_tokens = min(max_tokens, self.max_model_len // 4)
        return max_tokens, self.max_model_len - max_tokens - 8

    async def _generate(self, ids: list[int], max_tokens: int, kind: str, json_schema: dict | None = None) -> str:
        params = internal_sampling_params(max_tokens, {SESSION_KEY: ""}, json_schema)
        return (await self._run(ids, params, kind)).strip()

    def summary_slot(self) -> asyncio.Semaphore:
        return self._summary_slots

    async def summarize(self, source: str, max_tokens: int) -> str:
        max_tokens, budget = self._answer_budget(max_tokens)
        # enable_thinking: the paper writes summaries with thinking off; templates
        # without the switch ignore it.
        ids = self.counter.ids(summary_prompt(source), enable_thinking=False)
        for _ in range(4):  # shrink from the middle until it fits
            if len(ids) <= budget:
                break
            source = cap_head_and_tail(source, int(len(source) * budget / len(ids) * 0.9))
            ids = self.counter.ids(summary_prompt(source), enable_thinking=False)
        else:
            raise RuntimeError(f"summary prompt of {len(ids)} tokens does not fit {budget}")
        return await self._generate(ids, max_tokens, "summary")

    async def summarize_conversation(self, messages: Sequence[Message], max_tokens: int) -> str | None:
        max_tokens, budget = self._answer_budget(max_tokens)
        ids = self.counter.ids(self.counter.render(list(messages)), enable_thinking=False)
        if len(ids) > budget:
            return None
        return await self._generate(ids, max_tokens, "summary")

    async def complete(
        self, messages: Sequence[Message], max_tokens: int, json_schema: dict | None = None, kind: str = "internal"
    ) -> str:
        max_tokens, budget = self._answer_budget(max_tokens)
        ids = self.counter.ids(messages, enable_thinking=False)
        if len(ids) > budget:
            raise RuntimeError(f"{kind} prompt of {len(ids)} tokens does not fit the window")
        return await self._generate(ids, max_tokens, kind, json_schema)

    def kv_usage(self) -> float | None:
        """vLLM's KV-cache usage, read at most once a second (it changes by steps)."""
        now = time.monotonic()
        if now - self._kv[0] > 1.0:
            self._kv = (now, kv_cache_usage())
        return self._kv[1]

    def kv_capacity(self) -> int | None:
        return kv_capacity_tokens(self.engine_client)

    # -- memory rows in the worker ----------------------------------------------------
    def sync_memories(self, session: str, memories: Sequence[Memory], held: Sequence[int] = ()) -> None:
        if not self.worker_memory:
            return
        ids = tuple(sorted(m.id for m in memories))
        if ids == tuple(sorted(held)):
            self._pushed.pop(session, None)
            return
        pushed = self._pushed.get(session)
        now = time.monotonic()
        if pushed is not None and pushed[0] == ids and now - pushed[1] < REPUSH_AFTER_S:
            return  # on its way: the next capture shows it held
        # the rows the worker lacks; the ones it holds are kept (a worker that
        # evicted them since shows it at the next capture, and gets them again)
        kept = set(held)
        rows = [(m.id, np.ascontiguousarray(m.embedding, dtype="<f4").tobytes()) for m in memories if m.id not in kept]
        if self._spawn(self._rpc("pamer_memory_sync", session, [i for i in ids if i in kept], rows)):
            self._pushed[session] = (ids, now)

    def drop_memories(self, session: str) -> None:
        """Free the session's rows in the worker (its session left this process)."""
        self._pushed.pop(session, None)
        if self.worker_memory:
            self._spawn(self._rpc("pamer_memory_drop", session))

    def _spawn(self, coroutine: Any) -> bool:
        try:
            task = asyncio.get_running_loop().create_task(coroutine)
        except RuntimeError:  # no loop running here: the API server scores them
            coroutine.close()
            return False
        self._rpcs.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._rpcs.discard)
        return True

    async def _rpc(self, method: str, *args: Any) -> None:
        try:
            # no executor timeout: a late reply left in its queue would answer the next RPC
            await asyncio.wait_for(call_workers(self.engine_client, method, *args, timeout=None), RPC_TIMEOUT_S)
        except Exception:  # the API server scores what the worker lacks
            logger.warning("vllm-pamer: %s for a session failed", method, exc_info=True)

    async def embed(self, text: str) -> np.ndarray:
        if self.embedder is not None:
            return await self.embedder.embed(text)
        tokenizer = self.counter.tokenizer
        ids = tokenizer.encode(text, add_special_tokens=False)[-(self.max_model_len - 2) :] or [0]
        key = self.inbox.new_key()
        params = internal_sampling_params(1, {CAPTURE_KEY: key, SESSION_KEY: ""})
        await self._run(ids, params, "embed")
        record = await self.inbox.wait_for(key, self.capture_wait_s)
        if record is None:
            raise RuntimeError("no state was captured for the embedding request")
        return record.hidden_state().copy()
