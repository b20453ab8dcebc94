"""PaMER+ (paper Appendix C.3): PaMER plus step-level evidence.

Each memory keeps ``step_details`` linking it to the raw blocks it archived.
On a request that recalls memories, a selector (an internal engine request
shown R and the summary index, its answer constrained to the
``StepSelection`` JSON schema by vLLM's structured outputs) names summary ids
and the smallest ``raw_steps_needed``. ``selection.validate_selection``
checks it (Algorithm 2); only the named raw blocks go to a recall request,
whose result is injected after the recalled summaries. Results are cached by
sorted (summary ids, step ids). A valid empty selection injects nothing; an
invalid selection or a failed recall injects nothing and removes nothing: the
PaMER request stands.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec
from cachetools import LRUCache

from vllm_pamer.core.blocks import Message
from vllm_pamer.core.policies.base import (
    MAX_TRACKED_SESSIONS,
    PolicyConfig,
    PolicyContext,
    PolicyDecision,
    PolicyRequest,
    register_policy,
)
from vllm_pamer.core.policies.pamer.config import PaperConfig, schedule_config
from vllm_pamer.core.policies.pamer.paper_schedule import over_window
from vllm_pamer.core.policies.pamer.policy import Pamer
from vllm_pamer.core.policies.pamer.selection import SelectionResult, StepSelection, validate_selection
from vllm_pamer.core.policies.summary_writer import MEMORY_HEADER
from vllm_pamer.core.retry import with_retries
from vllm_pamer.core.store import Memory
from vllm_pamer.core.text import serialize_messages
from vllm_pamer.core.view import context_view, flatten

SelectionKey = tuple[tuple[int, ...], tuple[str, ...]]
"""Sorted (summary ids, step ids): what a recall result is cached by."""


def selection_schema(max_summaries: int, max_steps: int) -> dict[str, Any]:
    """StepSelection's JSON schema, bounded: a small model under a loose
    schema can write until max_tokens and leave the JSON unfinished."""
    return {
        "type": "object",
        "properties": {
            "summary_ids": {"type": "array", "items": {"type": "integer"}, "maxItems": max_summaries},
            "raw_steps_needed": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[0-9]{1,6}[.][0-9]{1,4}$"},
                "maxItems": max_steps,
            },
        },
        "required": ["summary_ids", "raw_steps_needed"],
        "additionalProperties": False,
    }


EVIDENCE_HEADER = "Recalled evidence from archived steps"
_CITED = re.compile(r"\[step (\d+\.\d+)\]")


class PamerPlusConfig(PaperConfig, frozen=True):
    """PaMER+ recalls step evidence on every recalling request (PaMER paper,
    Algorithm 2), so it runs the paper's schedule (``PaperConfig``)."""

    summary_layout: str = "text"
    """The paper's summary request (see ``SummaryConfig``)."""
    selector_max_tokens: int = 192
    """Output limit of the selector's JSON answer."""
    max_selected_steps: int = 8
    """Raw steps one selection may name."""
    recall_max_tokens: int = 512
    """Output limit of the recall call that reads the selected steps."""
    call_timeout_s: float = 100.0
    """Time limit of one selector or recall call."""
    call_attempts: int = 2
    """Attempts of one selector or recall call (errors only); a failure injects nothing, so few."""
    index_chars: int = 12_000
    """Summary index shown to the selector, cut at its end."""
    cache_per_session: int = 32
    """Recall results kept per session, by sorted (summary ids, step ids)."""


class _Rejected(Exception):
    """An invalid selection or recall: nothing is injected."""


def selector_prompt(recent: Sequence[Message], memories: Sequence[Memory], index_chars: int) -> list[Message]:
    lines = []
    for memory in sorted(memories, key=lambda m: m.id):
        lines.append(f"[memory {memory.id}] {memory.summary}")
        for d in memory.step_details:
            tools = ", ".join(t for t in d.tool_names if t) or "no tool"
            lines.append(f"  step {memory.id}.{d.step}: {tools} ({d.chars} chars)")
    return [
        {"role": "system", "content": "You decide which archived steps of an AI agent must be re-read."},
        {
            "role": "user",
            "content": (
                "Current steps of the agent:\n"
                + serialize_messages(recent)[-6000:]
                + "\n\nArchived memories and their steps:\n"
                + "\n".join(lines)[:index_chars]
                + "\n\nAnswer in JSON: summary_ids (memories to open) and raw_steps_needed "
                '(the fewest steps such as "3.1" whose exact content the next action needs). '
                "Use empty lists when the summaries suffice."
            ),
        },
    ]


def recall_prompt(goal: Sequence[Message], steps: dict[str, list[Message]]) -> list[Message]:
    source = "\n\n".join(f"[step {name}]\n{serialize_messages(messages)}" for name, messages in steps.items())
    return [
        {"role": "system", "content": "You recover facts from an agent's archived steps. Never invent."},
        {
            "role": "user",
            "content": (
                "The agent's current situation:\n"
                + serialize_messages(goal)[-4000:]
                + "\n\nArchived steps:\n"
                + source
                + "\n\nCopy exactly the facts from these steps that the agent needs now (ids, values, "
                "paths, results), each followed by its source like [step 3.1]. Write only the facts."
            ),
        },
    ]


@register_policy
class PamerPlus(Pamer):
    name = "pamer_plus"
    config_cls = PamerPlusConfig
    config: PamerPlusConfig

    @classmethod
    def config_classes(cls) -> tuple[type[PolicyConfig], ...]:
        return (PamerPlusConfig,)

    @classmethod
    def make_config(cls, options: dict[str, Any]) -> PolicyConfig:
        return schedule_config(options, {"paper": PamerPlusConfig})

    def __init__(self, config: PamerPlusConfig | None = None) -> None:
        super().__init__(config)
        self._cache: LRUCache[str, LRUCache[tuple[tuple[int, ...], tuple[str, ...]], str]] = LRUCache(
            MAX_TRACKED_SESSIONS
        )

    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        decision = await super().rewrite(request)
        if decision.action != "recalled":
            return decision  # compression, fallbacks and plain requests stand as PaMER made them
        context = self.needs_context(request)
        session, store = request.session_id, context.store
        try:
            evidence = await self._evidence(request, context)
        except _Rejected as exc:
            await store.log_event(session, "step_selection_rejected", {"reason": str(exc)})
            return _note(decision, f"step evidence rejected: {exc}")
        except Exception as exc:  # a failed selector or recall call: nothing injected
            await store.log_event(session, "step_recall_failure", {"error": f"{type(exc).__name__}: {exc}"})
            return _note(decision, f"step recall failed: {type(exc).__name__}")
        if evidence is None:
            return _note(decision, "selector: summaries suffice")
        at = len(request.conversation.prefix)
        if len(decision.messages) > at and str(decision.messages[at].get("content", "")).startswith(MEMORY_HEADER):
            at += 1  # right after the recalled summaries
        messages = decision.messages[:at] + [evidence] + decision.messages[at:]
        if over_window(self.config, context.services, messages, request.tools):  # the engine would refuse it
            return _note(decision, "step evidence left out: it would not fit the window")
        inserted = decision.tokens_inserted + context.services.count_tokens([evidence])
        return msgspec.structs.replace(
            decision, messages=messages, detail=decision.detail + "; step evidence injected", tokens_inserted=inserted
        )

    async def _evidence(self, request: PolicyRequest, context: PolicyContext) -> Message | None:
        cfg = self.config
        store, services, session = context.store, context.services, request.session_id
        memories = (await store.load(session)).memories
        recent = flatten(context_view(request.conversation, memories, cfg.retained_blocks).recent)
        schema = selection_schema(cfg.top_k, cfg.max_selected_steps)
        answer = await with_retries(
            lambda: services.complete(
                selector_prompt(recent, memories, cfg.index_chars),
                cfg.selector_max_tokens,
                json_schema=schema,
                kind="selector",
            ),
            cfg.call_timeout_s,
            cfg.call_attempts,
            "selector",
        )
        try:
            selection = msgspec.json.decode(answer, type=StepSelection)
        except msgspec.DecodeError as exc:
            raise _Rejected(f"selector answer is not a selection: {exc}") from None
        result: SelectionResult = validate_selection(selection, memories)
        if result.kind == "invalid":
            raise _Rejected(result.reason)
        if result.kind == "empty":
            return None

        names = [f"{s.memory_id}.{s.detail.step}" for s in result.steps]
        cache = self._cache.get(session)
        if cache is None:
            cache = self._cache[session] = LRUCache(cfg.cache_per_session)
        text = cache.get(result.cache_key)
        if text is None:
            raw = await store.raw_blocks(session, [s.detail.block_id for s in result.steps])
            if len(raw) != len(result.steps):
                raise _Rejected("a selected step has no stored raw block")
            steps = {name: raw[s.detail.block_id] for name, s in zip(names, result.steps)}
            goal = list(request.conversation.prefix[-1:]) + recent
            text = await with_retries(
                lambda: services.complete(recall_prompt(goal, steps), cfg.recall_max_tokens, kind="recall"),
                cfg.call_timeout_s,
                cfg.call_attempts,
                "recall",
            )
            foreign = sorted(set(_CITED.findall(text)) - set(names))
            if foreign:
                raise _Rejected(f"recall cites steps outside the selection: {foreign}")
            if not text.strip():
                raise _Rejected("recall came back empty")
            cache[result.cache_key] = text
        return {"role": "user", "content": f"{EVIDENCE_HEADER} {', '.join(names)}:\n{text.strip()}"}


def _note(decision: PolicyDecision, note: str) -> PolicyDecision:
    return msgspec.structs.replace(decision, detail=f"{decision.detail}; {note}")
