"""What every policy that writes summaries shares: its settings, the summary
requests (both layouts), the memory message a request shows, and the step
details a memory records of the blocks it archives."""

from __future__ import annotations

import json
from collections.abc import Sequence

from vllm_pamer.core.blocks import Block, Message
from vllm_pamer.core.engine import EngineServices
from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.policies.base import PolicyConfig
from vllm_pamer.core.retry import with_retries
from vllm_pamer.core.store import Memory, StepDetail
from vllm_pamer.core.text import cap_head_and_tail, serialize_messages
from vllm_pamer.core.view import flatten

MEMORY_HEADER = "Memory of earlier steps (summaries written when those steps were archived):"

SUMMARY_CHECKLIST = (
    "- the goal and how far it has progressed;\n"
    "- facts found, with identifiers and values copied exactly (ids, names, numbers, dates, paths, amounts);\n"
    "- decisions made and why; dead ends and what failed;\n"
    "- open questions.\n"
    "Write only the summary."
)
"""What every summary request asks to keep (both layouts)."""

SUMMARY_LAYOUTS = ("text", "conversation")
"""The summary request's layouts (``SummaryConfig.summary_layout``)."""


class SummaryConfig(PolicyConfig, frozen=True):
    """Settings of every policy that writes summaries (PaMER, the summary
    baselines); defaults are the PaMER paper's Table 14."""

    retained_blocks: int = 2
    """Most recent complete blocks always kept raw (R)."""
    summary_source_chars: int = 40_000
    """A longer source is covered from its beginning and its end."""
    summary_max_tokens: int = 1024
    """Output limit of one summary."""
    summary_timeout_s: float = 300.0
    """Time limit of one summary attempt, from when it gets its turn
    (``EngineServices.summary_slot``). It must exceed what a healthy engine
    needs for a summary request near the window: on a CPU that is minutes
    (``benchmarks/RESULTS.md``, "How long a summary takes on this CPU")."""
    summary_attempts: int = 8
    """Attempts before a summary counts as failed (errors only: a timeout is not retried, ``core/retry.py``)."""
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
        if self.summary_layout not in SUMMARY_LAYOUTS:
            raise ValueError(f"summary_layout must be 'text' or 'conversation', not {self.summary_layout!r}")


def summary_prompt(source: str) -> list[Message]:
    """The ``text`` layout: the old steps as one text under the instruction."""
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


def memory_message(memories: Sequence[Memory]) -> Message:
    """The message a request shows its memories in, in memory-id order."""
    parts = [MEMORY_HEADER] + [f"[memory {m.id}] {m.summary}" for m in sorted(memories, key=lambda m: m.id)]
    return {"role": "user", "content": "\n\n".join(parts)}


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


class StepFailure(Exception):
    """A summary or embedding step failed; ``rule`` names the fallback."""

    def __init__(self, rule: Fallback, detail: str) -> None:
        super().__init__(detail)
        self.rule, self.detail = rule, detail


async def write_summary(
    services: EngineServices,
    cfg: SummaryConfig,
    blocks: Sequence[Block],
    conversation: list[Message] | None = None,
    source: str | None = None,
) -> str:
    """A summary of ``blocks`` with the config's retries; ``conversation``
    (the ``conversation`` layout's request) is tried first, and the ``text``
    layout (``source``, default: the blocks serialized) when it does not fit.
    Raises StepFailure(SUMMARY_FAILURE) on failure or an empty answer."""
    text_source = cap_head_and_tail(
        source if source is not None else serialize_messages(flatten(blocks)), cfg.summary_source_chars
    )

    async def summarize() -> str:
        if conversation is not None:
            text = await services.summarize_conversation(conversation, cfg.summary_max_tokens)
            if text is not None:
                return text
        return await services.summarize(text_source, cfg.summary_max_tokens)

    try:
        async with services.summary_slot():  # the wait for a turn is not part of the time limit
            summary = await with_retries(summarize, cfg.summary_timeout_s, cfg.summary_attempts, "summary")
        if not isinstance(summary, str) or not summary.strip():
            raise RuntimeError("the summary came back empty")
    except Exception as exc:
        raise StepFailure(Fallback.SUMMARY_FAILURE, str(exc)) from exc
    return summary.strip()
