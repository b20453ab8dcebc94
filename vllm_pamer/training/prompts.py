"""The token ids the probe reads at a decision point: the messages rendered
as the server renders them (tool calls as text for templates without tool
support), the served chat template with ``add_generation_prompt=True``, then
cut to the probe's limit: a prompt longer than
``limit = min(max_model_len - 1, probe_limit)`` keeps its first
``head = min(keep_head, limit // 2)`` tokens and its newest ones, the middle
it leaves out growing in steps of ``cut_stride`` of the recent room
(``truncate_ids``), so between two steps a trajectory's cut prompts still
extend each other and the prefix cache serves them (``extract.py``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_pamer.core.render import render_tools_as_text, template_supports_tools
from vllm_pamer.core.tokens import TokenCounter

PROBE_LIMIT = 35_000
"""Longest prompt the probe reads (tokens), before the model window applies."""
KEEP_HEAD = 2_048
"""Tokens kept from the start of a prompt that is cut (the rest are the most recent)."""


def token_limit(max_model_len: int, probe_limit: int = PROBE_LIMIT) -> int:
    """Longest prompt fed to the engine: one token below the window (the request
    samples one token), and not above the probe limit."""
    return min(int(max_model_len) - 1, int(probe_limit))


def head_size(limit: int, keep_head: int = KEEP_HEAD) -> int:
    """Tokens a cut prompt keeps from its start: ``keep_head``, or half the
    limit on a window too small for it."""
    return max(0, min(int(keep_head), int(limit) // 2))


CUT_STRIDE = 0.5
"""Share of a cut prompt's recent room (``limit - head``) by which the cut
moves. Kept to the most recent tokens, a cut would move at every step and no
cut prompt would extend the one before (mini-swe's long trajectories);
moved in steps, it stays put while the trajectory grows, as the budget
schedule's requests stay append-only between compactions. 0: token by token."""


def truncate_ids(
    ids: Sequence[int], limit: int, keep_head: int = KEEP_HEAD, cut_stride: float = CUT_STRIDE
) -> tuple[list[int], bool]:
    """``ids`` if it fits ``limit``, else its first ``head_size(limit, keep_head)``
    tokens and its most recent ones: the middle left out is the overflow
    rounded up to a multiple of ``cut_stride`` of the recent room (a function
    of the length alone, so any run cuts a prompt alike). Returns (ids, cut)."""
    ids = list(ids)
    if len(ids) <= limit:
        return ids, False
    head = head_size(limit, keep_head)
    room = limit - head
    step = max(1, int(cut_stride * room))
    dropped = step * math.ceil((len(ids) - limit) / step)
    return ids[:head] + ids[head + dropped :] if room else ids[:head], True


@dataclass(frozen=True)
class PromptIds:
    ids: list[int]
    """Token ids fed to the engine (after any cut)."""
    context_tokens: int
    """Tokens of the templated prompt before the cut."""
    truncated: bool


class ChatPrompter:
    """Messages -> the token ids the server would feed the engine, then cut to
    the limit. ``tokenizer`` is the served model's (a transformers tokenizer)."""

    def __init__(self, tokenizer: Any, limit: int, keep_head: int = KEEP_HEAD, cut_stride: float = CUT_STRIDE) -> None:
        if limit < 2:
            raise ValueError(f"token limit {limit} is too small")
        if not 0 <= cut_stride <= 1:
            raise ValueError(f"cut stride {cut_stride} is not a share between 0 and 1")
        self.tokenizer = tokenizer
        self.limit = int(limit)
        self.keep_head = int(keep_head)
        self.cut_stride = float(cut_stride)
        self.tools_as_text = not template_supports_tools(getattr(tokenizer, "chat_template", None))
        self.counter = TokenCounter(tokenizer)

    def render(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the server hands them to the chat template."""
        copies = [dict(m) for m in messages]
        return render_tools_as_text(copies) if self.tools_as_text else copies

    def template_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return [int(t) for t in self.counter.ids(self.render(messages))]

    def __call__(self, messages: Sequence[Mapping[str, Any]]) -> PromptIds:
        ids = self.template_ids(messages)
        kept, cut = truncate_ids(ids, self.limit, self.keep_head, self.cut_stride)
        return PromptIds(kept, len(ids), cut)
