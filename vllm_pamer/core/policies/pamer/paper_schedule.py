"""PaMER's paper schedule (``schedule="paper"``): the PaMER paper's Algorithm 1.

Per request of a session, with its memories loaded:
1. take the view C_eff, then P / O / R (``core/view.py``);
2. decide (``should_compress``): tokens(O) >= ``min_candidate_tokens`` and the
   vote captured at this session's previous prefill says compress (or,
   ``window_guard``, C_eff does not fit the served window, so no vote can
   follow);
3. compress (``compress``): summarize O, embed the summary, store (summary,
   embedding, covered blocks, step details), and only then send P + R - the
   transaction; any failure sends the original request;
4. otherwise, with memories, recall (``recall``): the query is the state
   captured at the end of the session's previous prompt
   (``query_source="captured"``, the default; the paper embeds task + R, last
   ``query_chars`` characters, which is the fallback), take the Top-K memories
   by cosine and send P + E + O + R with their summaries E in stable (memory
   id) order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import numpy as np
from cachetools import LRUCache

from vllm_pamer.core.blocks import Block, Message, Tool
from vllm_pamer.core.engine import EngineServices
from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.policies.base import (
    MAX_TRACKED_SESSIONS,
    HeadVote,
    PolicyContext,
    PolicyDecision,
    PolicyRequest,
    Trigger,
)
from vllm_pamer.core.policies.pamer.config import PaperConfig
from vllm_pamer.core.policies.pamer.memory import MemoryWriter, captured_query
from vllm_pamer.core.policies.summary_writer import StepFailure, memory_message, step_details
from vllm_pamer.core.recall import SERVED_STATE_EMBEDDER, cosine_scores, cosine_top_k, merge_recall, stable_selection
from vllm_pamer.core.retry import with_retries
from vllm_pamer.core.store import Memory
from vllm_pamer.core.text import serialize_messages
from vllm_pamer.core.view import ContextView, context_view, flatten


class _AheadSummary(msgspec.Struct):
    """A summary started early for a session's expected next old blocks."""

    blocks: list[Block]
    task: asyncio.Task[tuple[str, np.ndarray]]


class _AheadCache(LRUCache[str, _AheadSummary]):
    """Early summaries by session; one pushed out is cancelled."""

    def popitem(self) -> tuple[str, _AheadSummary]:
        key, ahead = super().popitem()
        ahead.task.cancel()
        return key, ahead


def over_window(
    cfg: PaperConfig,
    services: EngineServices,
    messages: list[Message],
    tools: list[Tool] | None,
    at_most: int | None = None,
) -> bool:
    """``window_guard``: a request of these messages and tools would be
    refused (its prompt alone reaches the served window). ``at_most``: a
    known upper bound of their count (the request as received, of which
    they are a subset); below the window it spares a whole-history count."""
    window = services.max_model_len
    if not (cfg.window_guard and window):
        return False
    if at_most is not None and at_most < window:
        return False
    return services.prompt_tokens(messages, tools) >= window


class PaperSchedule:
    def __init__(self, config: PaperConfig, memory: MemoryWriter) -> None:
        self.config = config
        self.memory = memory
        # summarize_ahead: blocks expected to be old at the next request (with
        # their tokens), and the summary started for them.
        self._next_old: LRUCache[str, tuple[list[Block], int]] = LRUCache(MAX_TRACKED_SESSIONS)
        self._ahead = _AheadCache(MAX_TRACKED_SESSIONS)
        self._last_recall: LRUCache[str, list[int]] = LRUCache(MAX_TRACKED_SESSIONS)  # stable_recall
        # the memories the session's last request showed (the conversation layout resends them)
        self._last_shown: LRUCache[str, list[Memory]] = LRUCache(MAX_TRACKED_SESSIONS)

    async def on_vote(self, session_id: str, vote: HeadVote, context: PolicyContext) -> None:
        cfg = self.config
        candidate = self._next_old.pop(session_id, None)
        if not cfg.summarize_ahead or not vote.compress_vote or candidate is None:
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
        await context.store.log_event(session_id, "summary_ahead_started", {"blocks": len(blocks), "tokens": tokens})
        task = asyncio.get_running_loop().create_task(self.memory.summarize_and_embed(blocks, context.services))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "exception never retrieved"
        self._ahead[session_id] = _AheadSummary(blocks, task)

    async def rewrite(
        self, request: PolicyRequest, context: PolicyContext, memories: list[Memory], notes: list[str]
    ) -> PolicyDecision:
        cfg = self.config
        services, session = context.services, request.session_id
        original = request.conversation.messages()
        shown = self._last_shown.pop(session, [])  # what the previous request showed
        view = context_view(request.conversation, memories, cfg.retained_blocks)
        if view.covered:
            notes.append(f"{view.covered} blocks already in memory")
        if cfg.summarize_ahead:
            self._remember_next_old(session, view.live, services)
        old_tokens = services.count_tokens(flatten(view.old)) if view.old else 0
        if await self.should_compress(request, context, view, old_tokens, notes) is not None:
            decision, still_live = await self.compress(request, context, view, original, old_tokens, notes, shown)
            if cfg.summarize_ahead:
                self._remember_next_old(session, still_live, services)
            return decision
        if not memories:  # no block is covered, so C_eff is the request itself
            return PolicyDecision(original, "none", "; ".join(notes))
        return await self.recall(request, context, view, memories, notes)

    # -- the decision ---------------------------------------------------------------
    async def should_compress(
        self, request: PolicyRequest, context: PolicyContext, view: ContextView, old_tokens: int, notes: list[str]
    ) -> Trigger | None:
        """Why this request compresses (None: it does not), on the deferred
        vote of the previous prefill or the window guard."""
        if old_tokens < self.config.min_candidate_tokens:
            return None
        store, session = context.store, request.session_id
        vote = request.previous_vote
        voted = vote is not None and vote.compress_vote
        window = not voted and over_window(
            self.config, context.services, view.messages(), request.tools, at_most=request.prompt_tokens
        )
        if window:
            notes.append("request longer than the window: compressed without the vote")
            await store.log_event(session, "window_guard", {"old_tokens": old_tokens})
        elif vote is None:
            notes.append("no vote captured (probe failure): compression skipped")
            await store.log_event(session, "probe_missing", {"old_tokens": old_tokens})
        return "vote" if voted else "window" if window else None

    # -- the actions ------------------------------------------------------------------
    async def compress(
        self,
        request: PolicyRequest,
        context: PolicyContext,
        view: ContextView,
        original: list[Message],
        old_tokens: int,
        notes: list[str],
        shown: Sequence[Memory] = (),
    ) -> tuple[PolicyDecision, list[Block]]:
        """The compression transaction. Returns the decision and the blocks
        still live (raw in the request) afterwards."""
        cfg = self.config
        store, services = context.store, context.services
        session = request.session_id
        old, recent = list(view.old), list(view.recent)
        archived, kept_old = old, []
        result = None
        ahead = self._take_ahead(session, old) if cfg.summarize_ahead else None
        if ahead is not None:
            try:
                result = await asyncio.wait_for(asyncio.shield(ahead.task), cfg.summary_timeout_s)
                archived, kept_old = ahead.blocks, old[len(ahead.blocks) :]
                notes.append("summary written ahead")
            except Exception as exc:  # fall back to the synchronous path below
                ahead.task.cancel()  # (shielded from wait_for) not two summaries of these blocks
                await store.log_event(session, "summary_ahead_failed", {"error": str(exc)})
        if result is None:
            await store.log_event(session, "compression_started", {"blocks": len(old), "old_tokens": old_tokens})
            try:
                result = await self.memory.summarize_and_embed(old, services, view.prefix, shown)
            except StepFailure as failure:
                await store.log_event(session, failure.rule.value, {"error": failure.detail})
                return PolicyDecision.fallback(original, failure.rule, failure.detail), old + recent
            except Exception as exc:  # no rule names it: the start still has its end (the pipeline falls back)
                await store.log_event(session, Fallback.POLICY_ERROR.value, {"error": f"{type(exc).__name__}: {exc}"})
                raise
            except asyncio.CancelledError:  # the client went away: the start still has its end
                cancelled = {"reason": "cancelled"}
                await asyncio.shield(store.log_event(session, "compression_abandoned", cancelled))
                raise
        summary, embedding = result
        reduced = list(view.prefix) + flatten(kept_old) + flatten(recent)
        if services.count_tokens(reduced) >= services.count_tokens(original):
            await store.log_event(session, "compression_abandoned", {"blocks": len(archived), "reason": "no shrink"})
            return PolicyDecision(original, "none", "compression would not shrink the request"), old + recent
        try:
            memory_id = await store.commit_memory(
                session, summary, embedding, services.embedder_name, archived, step_details(archived)
            )
        except Exception as exc:  # storage precedes removal: nothing is removed
            await store.log_event(session, Fallback.STORAGE_FAILURE.value, {"error": str(exc)})
            return PolicyDecision.fallback(original, Fallback.STORAGE_FAILURE, str(exc)), old + recent
        await store.log_event(
            session, "compressed", {"memory_id": memory_id, "blocks": len(archived), "old_tokens": old_tokens}
        )
        notes.append(f"archived {len(archived)} blocks ({old_tokens} tokens) as memory {memory_id}")
        return PolicyDecision(reduced, "compressed", "; ".join(notes)), kept_old + recent

    async def recall(
        self,
        request: PolicyRequest,
        context: PolicyContext,
        view: ContextView,
        memories: list[Memory],
        notes: list[str],
    ) -> PolicyDecision:
        """P + E + O + R, E the Top-K memories' summaries; a failure sends the
        original request, not a partial one."""
        store, services, session = context.store, context.services, request.session_id
        try:
            chosen = await self._top_k(request, services, view, memories, notes)
        except Exception as exc:
            await store.log_event(session, Fallback.RECALL_FAILURE.value, {"error": str(exc)})
            return PolicyDecision.fallback(request.conversation.messages(), Fallback.RECALL_FAILURE, str(exc))
        inserted = [memory_message(chosen)] if chosen else []
        if self.config.summary_layout == "conversation":  # only that layout rebuilds what was shown
            self._last_shown[session] = list(chosen)
        ids = tuple(sorted(m.id for m in chosen))  # as memory_message shows them
        await store.log_event(session, "recalled", {"memory_ids": [m.id for m in chosen]})
        notes.append(f"recalled memories {list(ids)}")
        messages = list(view.prefix) + inserted + flatten(view.live)
        return PolicyDecision(messages, "recalled", "; ".join(notes), services.count_tokens(inserted), recalled=ids)

    async def _top_k(
        self,
        request: PolicyRequest,
        services: EngineServices,
        view: ContextView,
        memories: list[Memory],
        notes: list[str],
    ) -> list[Memory]:
        cfg = self.config
        query = captured_query(cfg, request, services, memories)
        captured = query is not None
        if query is None:
            query_text = serialize_messages(list(view.prefix[-1:]) + flatten(view.recent))[-cfg.query_chars :]
            query = await with_retries(
                lambda: services.embed(query_text), cfg.embed_timeout_s, cfg.embed_attempts, "query embedding"
            )
        else:
            notes.append("query: state captured at the previous request")
        # Embeddings of another embedder, or of another width (a model changed
        # under a kept store), are not comparable: those memories still cover
        # their blocks but are not searched.
        width = query.shape[0]
        searchable = [m for m in memories if m.embedder == services.embedder_name and m.embedding.shape[0] == width]
        chosen = None
        found = request.previous_recall if captured else None
        if found is not None:  # searched in the worker at that capture of the query
            chosen = merge_recall(found, query, searchable, cfg.top_k)
            if chosen is not None:
                notes.append("searched in the worker")
        if chosen is None:
            chosen = cosine_top_k(query, searchable, cfg.top_k)
        if services.embedder_name == SERVED_STATE_EMBEDDER:  # the space the worker searches in
            held = request.previous_recall.searched if request.previous_recall is not None else ()
            services.sync_memories(request.session_id, searchable, held)  # for the next capture's search
        if cfg.stable_recall:
            chosen = self._stabilize(request.session_id, query, searchable, chosen)
        return chosen

    def _stabilize(
        self, session: str, query: np.ndarray, searchable: list[Memory], fresh: list[Memory]
    ) -> list[Memory]:
        by_id = {m.id: m for m in searchable}
        previous = [i for i in self._last_recall.pop(session, []) if i in by_id]
        if previous:
            scores = cosine_scores(query, [by_id[i] for i in {*previous, *(m.id for m in fresh)}])
            ids = stable_selection(
                scores, previous, [m.id for m in fresh], self.config.top_k, self.config.recall_margin
            )
            fresh = [by_id[i] for i in ids]
        self._last_recall[session] = [m.id for m in fresh]
        return fresh

    def _remember_next_old(self, session: str, live: Sequence[Block], services: EngineServices) -> None:
        """If one block arrives, the next request's O is the live blocks but the
        newest ``retained_blocks - 1``: the candidate a summary may start on."""
        blocks = list(live[: max(0, len(live) - self.config.retained_blocks + 1)])
        self._next_old[session] = (blocks, services.count_tokens(flatten(blocks)))

    def _take_ahead(self, session: str, old: Sequence[Block]) -> _AheadSummary | None:
        """The early summary for this session if it covers a prefix of ``old``."""
        ahead = self._ahead.pop(session, None)
        if ahead is None:
            return None
        ids = [b.block_id for b in ahead.blocks]
        if ids and ids == [b.block_id for b in old[: len(ids)]]:
            return ahead
        ahead.task.cancel()
        return None
