"""PaMER (paper Algorithm 1): vote-driven compression transactions and Top-K recall.

Per request of a session:
1. load the session's memories (corrupt rows are discarded, never repaired);
2. C_eff: drop raw blocks already covered by committed memories;
3. split C_eff into P / O / R (R = ``retained_blocks`` most recent blocks);
4. if tokens(O) >= ``min_candidate_tokens`` and the vote captured at this
   session's previous prefill says compress (or, ``window_guard``, C_eff does
   not fit the served window, so no vote can follow): summarize O, embed the summary,
   store (summary, embedding, covered blocks, step details), and only then
   send P + R - the transaction; any failure sends the original request;
5. otherwise, with memories: the query is the state captured at the end of
   the session's previous prompt (``query_source="captured"``, the default;
   the paper embeds task + R, last ``query_chars`` characters, which is the
   fallback), take the Top-K memories by cosine and send P + E + O + R with
   their summaries E in stable (memory id) order.

Engine work (summaries, embeddings, token counts) comes through
``MemoryServices``; the policy itself is pure and testable without vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np

from vllm_pamer.core.blocks import Block, Message
from vllm_pamer.core.text import cap_head_and_tail, serialize_messages
from vllm_pamer.core.memory_store import Memory, MemoryStore, StepDetail, StoreError
from vllm_pamer.core.policies.base import (
    MemoryPolicy,
    PolicyConfig,
    PolicyDecision,
    PolicyRequest,
    register_policy,
)

logger = logging.getLogger("vllm_pamer.pamer")
T = TypeVar("T")

MEMORY_HEADER = "Memory of earlier steps (summaries written when those steps were archived):"
SERVED_STATE_EMBEDDER = "served-model-state"
"""Embedder name of memories embedded by the served model's own final-norm state."""


class MemoryServices(Protocol):
    """What the controller needs from the engine (see server/engine_services.py)."""

    embedder_name: str

    async def summarize(self, source: str, max_tokens: int) -> str: ...

    # Optional (``summary_layout="conversation"``): summarize the chat
    # ``messages`` as they are; None when they do not fit the window.
    # async def summarize_conversation(self, messages, max_tokens) -> str | None: ...

    async def embed(self, text: str) -> np.ndarray: ...

    def count_tokens(self, messages: Sequence[Message]) -> int: ...

    # Optional (``window_guard``): the served model's window in tokens, and
    # the prompt tokens of a request (messages and tools) as the engine counts them.
    # max_model_len: int
    # def prompt_tokens(self, messages, tools) -> int: ...


class SummaryConfig(PolicyConfig, frozen=True):
    """Settings of every policy that writes summaries (PaMER, the summary
    baselines); defaults are the paper's Table 14."""

    retained_blocks: int = 2
    """Most recent complete blocks always kept raw (R)."""
    summary_source_chars: int = 40_000
    """A longer source is covered from its beginning and its end."""
    summary_max_tokens: int = 1024
    summary_timeout_s: float = 100.0
    summary_attempts: int = 8
    summary_layout: str = "text"
    """``text``: the paper's summary request, the old steps as one text under
    an instruction. ``conversation`` (PaMER; beyond the paper): the request
    the engine saw last, cut after the old steps (P, the memories it showed,
    O), then the instruction as a new turn; its prefix is then already in
    vLLM's prefix cache, so the summary's prefill is mostly not recomputed.
    Falls back to ``text`` when the conversation does not fit the window."""

    def __post_init__(self) -> None:
        if self.retained_blocks < 0:
            raise ValueError("retained_blocks must be >= 0")
        if self.summary_layout not in ("text", "conversation"):
            raise ValueError(f"summary_layout must be 'text' or 'conversation', not {self.summary_layout!r}")


class PamerConfig(SummaryConfig, frozen=True):
    """Controller settings; defaults are the paper's Table 14."""

    min_candidate_tokens: int = 1024
    """Compression gate: tokens(O) must reach this."""
    top_k: int = 3
    """Memories recalled per request."""
    embed_timeout_s: float = 30.0
    embed_attempts: int = 8
    query_chars: int = 30_000
    """Recall query: task + R, limited to its final characters."""
    query_source: str = "captured"
    """``captured`` (SPEC's deferred retrieval; beyond the paper): the state
    the engine captured at the end of the session's previous prompt, which
    costs no request and ranked memories better than ``text`` in
    benchmarks/retrieval.py (MRR 0.781 vs 0.730 on 60 tau-bench
    trajectories); falls back to ``text`` when no state was captured or the
    memories come from another embedder. ``text``: the paper's recall query,
    task + R embedded by an internal request."""
    stable_recall: bool = True
    """Keep the memories recalled at the session's previous request unless a
    new one beats the weakest of them by ``recall_margin`` (cosine): the
    inserted text then stays identical between requests and vLLM's prefix
    cache keeps the prompt up to it (beyond the paper; its Prop. C.2 margin)."""
    recall_margin: float = 0.05
    window_guard: bool = True
    """Compress without waiting for the vote when the request as sent does not
    fit the served model's window (beyond the paper, whose probe reads up to
    35,000 tokens beside the agent). Here the vote comes from the served
    model's own prefill, which a request longer than the window never gets:
    without the guard the server refuses it, and every later request of the
    session, since the history only grows. The compression is the same
    transaction: if it fails the request goes through unchanged."""
    summarize_ahead: bool = False
    """Overlap mode: when request t's vote says compress (known at its prefill),
    start summarizing the blocks that will be old at request t+1 while the agent
    runs its tools; request t+1 commits that summary if it covers its old
    blocks. Off: the paper's synchronous mode (summary written inside t+1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.query_source not in ("text", "captured"):
            raise ValueError(f"query_source must be 'text' or 'captured', not {self.query_source!r}")


SUMMARY_CHECKLIST = (
    "- the goal and how far it has progressed;\n"
    "- facts found, with identifiers and values copied exactly (ids, names, numbers, dates, paths, amounts);\n"
    "- decisions made and why; dead ends and what failed;\n"
    "- open questions.\n"
    "Write only the summary."
)
"""What every summary request asks to keep (both layouts)."""


def remember(mapping: dict, key: Any, value: Any, limit: int) -> None:
    """``mapping[key] = value``, dropping the oldest entries beyond ``limit``
    (per-session state that must not grow without bound)."""
    mapping[key] = value
    while len(mapping) > limit:
        mapping.pop(next(iter(mapping)))


def summary_prompt(source: str) -> list[Message]:
    return [
        {
            "role": "system",
            "content": "You write the working memory of an AI agent. Be factual and complete; never invent.",
        },
        {
            "role": "user",
            "content": (
                "Below are earlier steps of an agent's work (its actions and the tool results). "
                "They will be removed from its context and replaced by your summary, so keep what "
                "later steps need:\n" + SUMMARY_CHECKLIST + "\n\n=== STEPS ===\n" + source + "\n=== END ==="
            ),
        },
    ]


def summary_instruction(after_memories: bool) -> Message:
    """The last turn of a ``conversation``-layout summary request."""
    where = "after the task and the memory list" if after_memories else "after the task"
    return {
        "role": "user",
        "content": (
            f"Stop working on the task. The steps above, {where}, will be removed from your context and "
            "replaced by a summary. Write that summary; keep what later steps need:\n" + SUMMARY_CHECKLIST
        ),
    }


async def with_retries(
    make_call: Callable[[], Awaitable[T]], timeout_s: float, attempts: int, what: str
) -> T:
    """Run ``make_call`` up to ``attempts`` times, each bounded by ``timeout_s``."""
    last: Exception | None = None
    for _ in range(max(1, attempts)):
        try:
            return await asyncio.wait_for(make_call(), timeout_s)
        except Exception as exc:  # every failure, timeouts included, is a retry
            last = exc
    raise RuntimeError(f"{what} failed after {attempts} attempts: {type(last).__name__}: {last}")


def cosine_scores(query: np.ndarray, memories: Sequence[Memory]) -> dict[int, float]:
    """Cosine of the query with each memory, by id; zero vectors (query or
    memory) never score. Embeddings of another dimension are an error."""
    q = np.asarray(query, dtype=np.float64).reshape(-1)
    q_norm = np.linalg.norm(q)
    if q_norm == 0:
        return {}
    scores = {}
    for memory in memories:
        e = memory.embedding.astype(np.float64).reshape(-1)
        if e.shape != q.shape:
            raise ValueError(f"memory {memory.id} has embedding dim {e.shape[0]}, query has {q.shape[0]}")
        norm = np.linalg.norm(e)
        if norm > 0:
            scores[memory.id] = float(q @ e / (q_norm * norm))
    return scores


def cosine_top_k(query: np.ndarray, memories: Sequence[Memory], k: int) -> list[Memory]:
    """Top-k memories by cosine; zero vectors never match; ties -> lower id."""
    scores = cosine_scores(query, memories)
    ranked = sorted((m for m in memories if m.id in scores), key=lambda m: (-scores[m.id], m.id))
    return ranked[:k]


def stable_selection(
    scores: dict[int, float], previous: Sequence[int], fresh: Sequence[int], k: int, margin: float
) -> list[int]:
    """Top-k that changes only for a reason: the previous selection is kept
    (members that no longer exist drop out) and a fresh candidate enters only
    by beating the weakest kept member by more than ``margin``, or to fill a
    free place. Returns sorted ids."""
    kept = [i for i in previous if i in scores][:k]
    for candidate in sorted((i for i in fresh if i not in kept), key=lambda i: (-scores[i], i)):
        if len(kept) < k:
            kept.append(candidate)
            continue
        weakest = min(kept, key=lambda i: (scores[i], -i))
        if scores[candidate] > scores[weakest] + margin:
            kept[kept.index(weakest)] = candidate
    return sorted(kept)


def step_details(blocks: Sequence[Block]) -> list[StepDetail]:
    """What a memory records of each block it archives (PaMER+ selects by these)."""
    return [
        StepDetail(
            step=index,
            block_id=block.block_id,
            tool_names=tuple(c.get("function", {}).get("name", "") for c in block.assistant.get("tool_calls") or []),
            chars=len(json.dumps(list(block.messages))),
        )
        for index, block in enumerate(blocks)
    ]


def memory_message(memories: Sequence[Memory]) -> Message:
    parts = [MEMORY_HEADER] + [f"[memory {m.id}] {m.summary}" for m in sorted(memories, key=lambda m: m.id)]
    return {"role": "user", "content": "\n\n".join(parts)}


class _AheadSummary(msgspec.Struct):
    """A summary started early for a session's expected next old blocks."""

    blocks: list[Block]
    task: Any  # asyncio.Task[tuple[str, np.ndarray]]


class PamerContext(msgspec.Struct, frozen=True):
    """Per-server handles the controller works with (passed in PolicyRequest.memory)."""

    store: MemoryStore
    services: Any  # MemoryServices


@register_policy
class Pamer(MemoryPolicy):
    name = "pamer"
    config_cls = PamerConfig
    requires_heads = True
    max_tracked_sessions = 10_000

    def __init__(self, config: PamerConfig | None = None) -> None:
        super().__init__(config)
        # summarize_ahead state, per session: blocks expected to be old at the
        # next request, and the summary started for them.
        self._next_old: dict[str, tuple[list[Block], int]] = {}
        self._ahead: dict[str, _AheadSummary] = {}
        self._last_recall: dict[str, list[int]] = {}  # stable_recall: ids recalled last, per session
        self._shown: dict[str, list[Memory]] = {}  # memories the session's previous request showed

    async def on_vote(self, session_id: str, vote, memory) -> None:
        cfg: PamerConfig = self.config
        candidate = self._next_old.pop(session_id, None)
        if not cfg.summarize_ahead or memory is None or not vote.compress or candidate is None:
            return
        blocks, tokens = candidate
        if tokens < cfg.min_candidate_tokens:
            return
        running = self._ahead.pop(session_id, None)
        if running is not None:
            if [b.block_id for b in running.blocks] == [b.block_id for b in blocks]:
                self._ahead[session_id] = running  # already summarizing exactly these
                return
            running.task.cancel()  # stale: the session moved on
        memory.store.log_event(session_id, "summary_ahead_started", {"blocks": len(blocks), "tokens": tokens})
        task = asyncio.get_running_loop().create_task(self._summarize_and_embed(blocks, memory.services))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "exception never retrieved"
        self._ahead[session_id] = _AheadSummary(blocks, task)
        while len(self._ahead) > self.max_tracked_sessions:
            self._ahead.pop(next(iter(self._ahead))).task.cancel()

    async def _summarize_and_embed(
        self, blocks: list[Block], services, prefix: list[Message] | None = None, shown: Sequence[Memory] = ()
    ) -> tuple[str, np.ndarray]:
        """``prefix`` (P) and ``shown`` (the memories the previous request
        showed) rebuild what the engine saw before ``blocks``, for the
        conversation layout; without ``prefix`` the text layout is used."""
        cfg: PamerConfig = self.config
        old_messages = [m for b in blocks for m in b.messages]
        source = cap_head_and_tail(serialize_messages(old_messages), cfg.summary_source_chars)
        by_conversation = None
        if cfg.summary_layout == "conversation" and prefix is not None:
            by_conversation = getattr(services, "summarize_conversation", None)
        if by_conversation is not None:
            seen = list(prefix) + ([memory_message(shown)] if shown else [])
            conversation = seen + old_messages + [summary_instruction(after_memories=bool(shown))]

        async def summarize() -> str:
            if by_conversation is not None:
                text = await by_conversation(conversation, cfg.summary_max_tokens)
                if text is not None:
                    return text
            return await services.summarize(source, cfg.summary_max_tokens)

        try:
            summary = await with_retries(summarize, cfg.summary_timeout_s, cfg.summary_attempts, "summary")
            if not isinstance(summary, str) or not summary.strip():
                raise RuntimeError("the summary came back empty")
        except Exception as exc:
            raise _StepFailure("summary_failure", str(exc)) from exc
        try:
            embedding = await with_retries(
                lambda: services.embed(summary), cfg.embed_timeout_s, cfg.embed_attempts, "summary embedding"
            )
        except Exception as exc:
            raise _StepFailure("embedding_failure", str(exc)) from exc
        return summary.strip(), embedding

    def _take_ahead(self, session: str, old: list[Block]) -> _AheadSummary | None:
        """The early summary for this session if it covers a prefix of ``old``."""
        ahead = self._ahead.pop(session, None)
        if ahead is None:
            return None
        ids = [b.block_id for b in ahead.blocks]
        if ids and ids == [b.block_id for b in old[: len(ids)]]:
            return ahead
        ahead.task.cancel()
        return None

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        context: PamerContext | None = request.memory
        if context is None:
            raise RuntimeError("pamer needs a memory store and engine services")
        cfg: PamerConfig = self.config
        store, services = context.store, context.services
        session = request.session_id
        original = request.conversation.messages()

        # 1-2. memory and C_eff
        try:
            loaded = store.load(session)
        except StoreError as exc:
            return PolicyDecision(original, "fallback:storage_failure", str(exc))
        notes = [f"discarded {loaded.discarded} corrupt memories"] if loaded.discarded else []
        shown = self._shown.pop(session, [])  # what the previous request showed
        covered = {block_id for m in loaded.memories for block_id in m.covered_block_ids}
        prefix = list(request.conversation.prefix)
        live = [b for b in request.conversation.blocks if b.block_id not in covered]
        dropped = len(request.conversation.blocks) - len(live)
        if dropped:
            notes.append(f"{dropped} blocks already in memory")
        # 3. P / O / R
        cut = max(0, len(live) - cfg.retained_blocks)
        old, recent = live[:cut], live[cut:]
        old_messages = [m for b in old for m in b.messages]
        recent_messages = [m for b in recent for m in b.messages]

        if cfg.summarize_ahead:
            self._remember_next_old(session, live, services)

        # 4. compression (deferred vote of the previous prefill)
        vote = request.previous_vote
        old_tokens = services.count_tokens(old_messages) if old else 0
        if old_tokens >= cfg.min_candidate_tokens:
            voted = vote is not None and vote.compress
            live_messages = prefix + old_messages + recent_messages  # C_eff, what goes out without compression
            over_window = not voted and self._over_window(
                services, live_messages, request.tools, at_most=request.prompt_tokens
            )
            if over_window:
                notes.append("request longer than the window: compressed without the vote")
                store.log_event(session, "window_guard", {"old_tokens": old_tokens})
            elif vote is None:
                notes.append("no vote captured (probe failure): compression skipped")
                store.log_event(session, "probe_missing", {"old_tokens": old_tokens})
            if voted or over_window:
                decision, still_live = await self._compress(
                    request, context, prefix, old, recent, original, old_tokens, notes, shown
                )
                if cfg.summarize_ahead:
                    self._remember_next_old(session, still_live, services)
                return decision

        # 5. recall
        if loaded.memories:
            try:
                query = self._captured_query(request, services, loaded.memories)
                if query is None:
                    query_text = serialize_messages(prefix[-1:] + recent_messages)[-cfg.query_chars:]
                    query = await with_retries(
                        lambda: services.embed(query_text), cfg.embed_timeout_s, cfg.embed_attempts, "query embedding"
                    )
                else:
                    notes.append("query: state captured at the previous request")
                # Embeddings of another embedder are not comparable: those
                # memories still cover their blocks but are not searched.
                searchable = [m for m in loaded.memories if m.embedder == services.embedder_name]
                search = getattr(services, "top_k", None)  # the server's device-resident index
                if search is not None:
                    chosen = search(session, query, searchable, cfg.top_k)
                else:
                    chosen = cosine_top_k(query, searchable, cfg.top_k)
                if cfg.stable_recall:
                    chosen = self._stabilize(session, query, searchable, chosen)
            except Exception as exc:  # recall failure: the original request, not a partial one
                store.log_event(session, "recall_failure", {"error": str(exc)})
                return PolicyDecision(original, "fallback:recall_failure", str(exc))
            inserted = [memory_message(chosen)] if chosen else []
            if cfg.summary_layout == "conversation":  # only that layout rebuilds what was shown
                remember(self._shown, session, list(chosen), self.max_tracked_sessions)
            messages = prefix + inserted + old_messages + recent_messages
            store.log_event(session, "recalled", {"memory_ids": [m.id for m in chosen]})
            notes.append(f"recalled memories {sorted(m.id for m in chosen)}")
            return PolicyDecision(
                messages, "recalled", "; ".join(notes), services.count_tokens(inserted),
                recalled=tuple(sorted(m.id for m in chosen)),  # as memory_message shows them
            )
        # Without memories no block is covered, so C_eff is the request itself.
        return PolicyDecision(original, "none", "; ".join(notes))

    def _over_window(self, services, messages: list[Message], tools: list[dict] | None,
                     at_most: int | None = None) -> bool:
        """``window_guard``: a request of these messages and tools would be
        refused (its prompt alone reaches the window the services report;
        window unknown: never). ``at_most``: a known upper bound of their
        count (the request as received, of which they are a subset); below the
        window it spares a whole-history count on the event loop."""
        window = getattr(services, "max_model_len", None)
        if not (self.config.window_guard and window):
            return False
        if at_most is not None and at_most < window:
            return False
        prompt_tokens = getattr(services, "prompt_tokens", None)
        tokens = prompt_tokens(messages, tools) if prompt_tokens else services.count_tokens(messages)
        return tokens >= window

    def _captured_query(self, request: PolicyRequest, services, memories: list[Memory]) -> np.ndarray | None:
        """The deferred query (``query_source="captured"``) when it can stand in
        for the text query: a state was captured and it lives in the space the
        memories were embedded in (the served model's, same width)."""
        state = request.previous_state
        if self.config.query_source != "captured" or state is None:
            return None
        if services.embedder_name != SERVED_STATE_EMBEDDER:
            return None
        widths = {len(m.embedding) for m in memories if m.embedder == SERVED_STATE_EMBEDDER}
        return np.asarray(state, dtype=np.float32) if widths == {len(state)} else None

    def _stabilize(self, session: str, query: np.ndarray, searchable: list[Memory], fresh: list[Memory]) -> list[Memory]:
        by_id = {m.id: m for m in searchable}
        previous = [i for i in self._last_recall.pop(session, []) if i in by_id]
        if previous:
            scores = cosine_scores(query, [by_id[i] for i in {*previous, *(m.id for m in fresh)}])
            ids = stable_selection(scores, previous, [m.id for m in fresh], self.config.top_k, self.config.recall_margin)
            fresh = [by_id[i] for i in ids]
        remember(self._last_recall, session, [m.id for m in fresh], self.max_tracked_sessions)
        return fresh

    def _remember_next_old(self, session: str, live: list[Block], services) -> None:
        """If one block arrives, the next request's O is the live blocks but the
        newest ``retained_blocks - 1``: the candidate a summary may start on."""
        blocks = live[: max(0, len(live) - self.config.retained_blocks + 1)]
        tokens = services.count_tokens([m for b in blocks for m in b.messages])
        remember(self._next_old, session, (blocks, tokens), self.max_tracked_sessions)

    async def _compress(
        self, request, context, prefix, old: list[Block], recent: list[Block], original, old_tokens, notes, shown=()
    ):
        """The compression transaction. Returns the decision and the blocks
        still live (raw in the request) afterwards."""
        cfg: PamerConfig = self.config
        recent_messages = [m for b in recent for m in b.messages]
        store, services = context.store, context.services
        session = request.session_id
        archived, kept_old = old, []
        result = None
        ahead = self._take_ahead(session, old) if cfg.summarize_ahead else None
        if ahead is not None:
            try:
                result = await asyncio.wait_for(asyncio.shield(ahead.task), cfg.summary_timeout_s)
                archived, kept_old = ahead.blocks, old[len(ahead.blocks):]
                notes.append("summary written ahead")
            except Exception as exc:  # fall back to the synchronous path below
                store.log_event(session, "summary_ahead_failed", {"error": str(exc)})
        if result is None:
            store.log_event(session, "compression_started", {"blocks": len(old), "old_tokens": old_tokens})
            try:
                result = await self._summarize_and_embed(old, services, prefix, shown)
            except _StepFailure as failure:
                store.log_event(session, failure.rule, {"error": failure.detail})
                return PolicyDecision(original, f"fallback:{failure.rule}", failure.detail), old + recent
        summary, embedding = result
        reduced = prefix + [m for b in kept_old for m in b.messages] + recent_messages
        if services.count_tokens(reduced) >= services.count_tokens(original):
            return PolicyDecision(original, "none", "compression would not shrink the request"), old + recent
        try:
            memory_id = store.commit_memory(
                session, summary, embedding, services.embedder_name, archived, step_details(archived)
            )
        except Exception as exc:  # storage precedes removal: nothing is removed
            store.log_event(session, "storage_failure", {"error": str(exc)})
            return PolicyDecision(original, "fallback:storage_failure", str(exc)), old + recent
        store.log_event(
            session, "compressed", {"memory_id": memory_id, "blocks": len(archived), "old_tokens": old_tokens}
        )
        notes.append(f"archived {len(archived)} blocks ({old_tokens} tokens) as memory {memory_id}")
        return PolicyDecision(reduced, "compressed", "; ".join(notes)), kept_old + recent


class _StepFailure(Exception):
    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(detail)
        self.rule, self.detail = rule, detail
