"""SAM, State-Adaptive Memory (SAM paper §2.2): pages, cues and intent-driven recall.

Write path: when the live context (prefix + blocks not yet paged) reaches
``trigger_tokens`` (default: ``trigger_share`` of the model window), the live
blocks before the ``retained_blocks`` most recent ones are grouped into
contiguous pages of at most ``page_tokens``; each page gets a cue (a short
summary: what was established, ruled out, left open) and is stored raw with
it, in one transaction per page. The cues stay in context as a numbered list.

Read path: the request carries a ``memory`` tool (pages: page numbers, at most
``max_pages_per_call``; goal: what the agent is trying to recover). When the
model calls it, the server resolves the call itself: an internal request
reconstructs, from those raw pages and under that goal, what the agent needs,
and the generation continues; the client sees only its own tools.

Nothing is removed before its page is stored; any failure sends the request
unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from vllm_pamer.core.blocks import Block, Message, Tool
from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.policies.base import (
    MemoryPolicy,
    PolicyConfig,
    PolicyContext,
    PolicyDecision,
    PolicyRequest,
    register_policy,
)
from vllm_pamer.core.policies.summary_writer import step_details
from vllm_pamer.core.retry import with_retries
from vllm_pamer.core.store import NO_EMBEDDING, Memory, MemoryStore, StoreError
from vllm_pamer.core.text import cap_head_and_tail, serialize_messages
from vllm_pamer.core.view import context_view, flatten

MEMORY_TOOL_NAME = "memory"
CUES_HEADER = "Memory pages"
EMBEDDER = "sam-page"  # marks pages among a session's memories


class SamConfig(PolicyConfig, frozen=True):
    trigger_tokens: int = 0
    """Live-context size that triggers consolidation (0: ``trigger_share`` of the window)."""
    trigger_share: float = 0.5
    """Share of the served window that triggers consolidation when ``trigger_tokens`` is 0."""
    page_tokens: int = 2048
    """Token budget of one page (a larger block is a page by itself)."""
    retained_blocks: int = 2
    """Most recent blocks never paged."""
    cue_max_tokens: int = 256
    """Output limit of one page's cue."""
    recall_max_tokens: int = 512
    """Output limit of one ``memory`` tool answer."""
    page_source_chars: int = 40_000
    """Characters of raw pages one ``memory`` call reads (shared among its pages)."""
    max_pages_per_call: int = 5
    """Pages one ``memory`` call may open."""
    call_timeout_s: float = 100.0
    """Time limit of one cue or recall call."""
    call_attempts: int = 3
    """Attempts of one cue or recall call (errors only: a timeout is not retried)."""


def memory_tool(max_pages: int) -> Tool:
    return {
        "type": "function",
        "function": {
            "name": MEMORY_TOOL_NAME,
            "description": (
                "Recover details of earlier steps that were archived as numbered memory pages "
                "(listed under 'Memory pages'). Give the page numbers and what you need from them."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "pages": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": max_pages},
                    "goal": {"type": "string", "description": "what you are trying to recover"},
                },
                "required": ["pages", "goal"],
            },
        },
    }


def cue_prompt(page: Sequence[Message]) -> list[Message]:
    return [
        {"role": "system", "content": "You write memory cues for an AI agent. Be brief and factual."},
        {
            "role": "user",
            "content": (
                "These steps of an agent will be archived as one page; write its cue in a few lines: "
                "what was established (with key identifiers), what was ruled out, what is unresolved, "
                "and what may matter later.\n\n=== PAGE ===\n" + serialize_messages(page) + "\n=== END ==="
            ),
        },
    ]


def recall_prompt(goal: str, pages: dict[int, list[Message]], budget_chars: int) -> list[Message]:
    share = max(1000, budget_chars // max(1, len(pages)))
    source = "\n\n".join(
        f"=== PAGE {number} ===\n{cap_head_and_tail(serialize_messages(messages), share)}"
        for number, messages in pages.items()
    )
    return [
        {"role": "system", "content": "You reconstruct what an AI agent needs from its archived pages. Never invent."},
        {
            "role": "user",
            "content": f"Goal: {goal}\n\n{source}\n\nWrite only the information from these pages that serves the goal, "
            "with identifiers and values copied exactly.",
        },
    ]


def cues_message(pages: Sequence[Memory]) -> Message:
    lines = [f"{CUES_HEADER} (earlier steps, archived; call the `{MEMORY_TOOL_NAME}` tool to recover details):"]
    lines += [f"[page {number}] {memory.summary}" for number, memory in enumerate(pages, start=1)]
    return {"role": "user", "content": "\n".join(lines)}


def paginate(blocks: Sequence[Block], tokens: Sequence[int], budget: int) -> list[list[Block]]:
    """Contiguous pages of at most ``budget`` tokens (a larger block alone)."""
    pages: list[list[Block]] = []
    size = 0
    for block, n in zip(blocks, tokens):
        if not pages or size + n > budget:
            pages.append([])
            size = 0
        pages[-1].append(block)
        size += n
    return pages


@register_policy
class Sam(MemoryPolicy):
    name = "sam"
    config_cls = SamConfig
    config: SamConfig

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        context = self.needs_context(request)
        cfg = self.config
        store, services, session = context.store, context.services, request.session_id
        original = request.conversation.messages()
        try:
            pages = await self._pages(store, session)
        except StoreError as exc:
            return PolicyDecision.fallback(original, Fallback.STORAGE_FAILURE, str(exc))
        view = context_view(request.conversation, pages, cfg.retained_blocks)
        trigger = cfg.trigger_tokens or int(cfg.trigger_share * services.max_model_len)
        candidates, live = list(view.old), list(view.live)
        action, notes = "rewritten", []
        if candidates and services.count_tokens(view.messages()) >= trigger:
            sizes = [services.count_tokens(list(b.messages)) for b in candidates]
            for page in paginate(candidates, sizes, cfg.page_tokens):
                prompt = cue_prompt(flatten(page))
                try:
                    cue = await with_retries(
                        lambda: services.complete(prompt, cfg.cue_max_tokens, kind="cue"),  # noqa: B023 - awaited here
                        cfg.call_timeout_s,
                        cfg.call_attempts,
                        "cue",
                    )
                    if not cue.strip():
                        raise RuntimeError("the cue came back empty")
                    await store.commit_memory(session, cue.strip(), NO_EMBEDDING, EMBEDDER, page, step_details(page))
                except Exception as exc:  # pages stored so far stay stored; this request goes out unchanged
                    await store.log_event(session, "page_failure", {"error": f"{type(exc).__name__}: {exc}"})
                    return PolicyDecision.fallback(original, Fallback.SUMMARY_FAILURE, str(exc))
            await store.log_event(session, "paged", {"blocks": len(candidates)})
            action = "compressed"
            notes.append(f"paged {len(candidates)} blocks")
            pages = await self._pages(store, session)
            live = list(view.recent)
        if not pages:
            return PolicyDecision(original, "none")
        cues = cues_message(pages)
        messages = list(view.prefix) + [cues] + flatten(live)
        notes.append(f"{len(pages)} pages in memory")
        tools = (memory_tool(cfg.max_pages_per_call),)
        return PolicyDecision(messages, action, "; ".join(notes), services.count_tokens([cues]), extra_tools=tools)

    async def resolve_tool_call(self, session_id: str, name: str, arguments: str, context: PolicyContext) -> str:
        cfg = self.config
        if name != MEMORY_TOOL_NAME:
            raise NotImplementedError(f"sam has no tool {name!r}")
        store = context.store
        pages = await self._pages(store, session_id)
        try:
            args = json.loads(arguments or "{}")
            numbers = [int(n) for n in args.get("pages", [])]
            goal = str(args.get("goal", "")).strip()
        except (ValueError, TypeError, AttributeError):
            numbers, goal = [], ""
        bad = [n for n in numbers if not 1 <= n <= len(pages)]
        if not numbers or bad or len(numbers) > cfg.max_pages_per_call:
            # the model reads the error as the tool's result and can call again
            await store.log_event(
                session_id, "memory_tool", {"error": "bad arguments", "arguments": str(arguments)[:200]}
            )
            return (
                f'memory error: call memory with {{"pages": [1 to {cfg.max_pages_per_call} page numbers '
                f'between 1 and {len(pages)}], "goal": "what you need"}}' + (f"; {bad} do not exist" if bad else "")
            )
        chosen = {n: pages[n - 1] for n in dict.fromkeys(numbers)}
        raw = await store.raw_blocks(session_id, [b for m in chosen.values() for b in m.covered_block_ids])
        sources = {n: [msg for b in m.covered_block_ids for msg in raw.get(b, [])] for n, m in chosen.items()}
        text = await with_retries(
            lambda: context.services.complete(
                recall_prompt(goal or "what these pages established", sources, cfg.page_source_chars),
                cfg.recall_max_tokens,
                kind="recall",
            ),
            cfg.call_timeout_s,
            cfg.call_attempts,
            "memory recall",
        )
        await store.log_event(session_id, "memory_tool", {"pages": list(chosen), "goal": goal[:200]})
        return text or "memory: nothing relevant found on those pages"

    @staticmethod
    async def _pages(store: MemoryStore, session: str) -> list[Memory]:
        """The session's pages, oldest first (page numbers are positions here)."""
        memories = (await store.load(session)).memories
        return sorted((m for m in memories if m.embedder == EMBEDDER), key=lambda m: m.id)
