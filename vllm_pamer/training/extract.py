"""Prefill states for the memory heads: ``vllm-pamer extract``.

For every labelled decision point (``vllm-pamer annotate``), the served model's
final-norm state at the last prompt token, for two inputs:

* ``full``: the context as served, ``messages[:i]`` (P + O + R);
* ``recent2``: the paper's compact input P + R_t (the prefix and the
  ``n_recent`` (2) most recent blocks; ``decision_contexts`` gives the ranges).

The states come from the vLLM engine (``vllm_pamer.offline_engine``) through
the same capture path as serving (``vllm_pamer.worker.capture``: the rows
``compute_logits`` receives, published on the ZeroMQ channel): no second model
code path. Each prompt is one request with ``max_tokens=1`` tagged with a
capture key.

Token ids are what the server would send: the messages rendered as the server
renders them (tool calls as text for templates without tool support), then the
served chat template with ``add_generation_prompt=True``. A prompt longer than
``limit = min(max_model_len - 1, probe_limit)`` (probe limit 35,000) keeps its
first ``head = min(keep_head, limit // 2)`` tokens (``keep_head`` 2,048) and
its most recent ``limit - head`` tokens.

Batching and prefix caching: the points are ordered by trajectory (data file
order) and step, and one shard's prompts go to the engine in one
``LLM.generate`` call, in that order (full_t, recent2_t, full_t+1, ...).
``full_t`` is a prefix of ``full_t+1`` (the generation prompt opens the next
assistant message), and every prompt of a trajectory starts with P, so the
prefix cache serves most of each prompt.

Output (``--out DIR``): the states format of ``vllm_pamer.training.data``
(a manifest, then shards of ``full`` / ``recent2`` tensors and metadata
lines). A run skips the shards that are complete for its points (resume); a
directory made with other settings is refused.

Layerwise (``--layers``, the paper's depth diagnostic): the worker also taps
decoder blocks at 1/8, 1/4, 1/2 and 3/4 of the depth (or the blocks given) and
the final norm, at the last prompt token and averaged over the prompt, for the
``full`` context; shards then also hold ``layers_last`` and ``layers_mean``
(``[n, taps, d]``) and the manifest names the taps. A mean needs every prompt
token to pass through the layers, so such a run turns prefix caching off (it is
slower: subsample).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_pamer.core.render import render_tools_as_text, template_supports_tools
from vllm_pamer.core.tokens import TokenCounter
from vllm_pamer.offline_engine import CaptureEngine
from vllm_pamer.training.annotate import AnnotatorSettings, DecisionContext, DecisionPoint, decision_contexts
from vllm_pamer.training.data import FORMAT, open_run, shard_complete, write_shard
from vllm_pamer.worker.layer_taps import tap_names

PROBE_LIMIT = 35_000
"""Longest prompt the probe reads (tokens), before the model window applies."""
KEEP_HEAD = 2_048
"""Tokens kept from the start of a prompt that is cut (the rest are the most recent)."""
SHARD_SIZE = 256
"""Decision points per shard (one ``LLM.generate`` call of twice as many prompts)."""


class ExtractError(RuntimeError):
    """The labels do not fit the data, or the engine does not fit the run."""


# --------------------------------------------------------------------------------------
# Token ids
# --------------------------------------------------------------------------------------


def token_limit(max_model_len: int, probe_limit: int = PROBE_LIMIT) -> int:
    """Longest prompt fed to the engine: one token below the window (the request
    samples one token), and not above the probe limit."""
    return min(int(max_model_len) - 1, int(probe_limit))


def head_size(limit: int, keep_head: int = KEEP_HEAD) -> int:
    """Tokens a cut prompt keeps from its start: ``keep_head``, or half the
    limit on a window too small for it."""
    return max(0, min(int(keep_head), int(limit) // 2))


def truncate_ids(ids: Sequence[int], limit: int, keep_head: int = KEEP_HEAD) -> tuple[list[int], bool]:
    """``ids`` if it fits ``limit``, else its first ``head_size(limit, keep_head)``
    tokens and its most recent ``limit - head`` tokens. Returns (ids, cut)."""
    ids = list(ids)
    if len(ids) <= limit:
        return ids, False
    head = head_size(limit, keep_head)
    tail = limit - head
    return ids[:head] + (ids[-tail:] if tail else []), True


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

    def __init__(self, tokenizer: Any, limit: int, keep_head: int = KEEP_HEAD) -> None:
        if limit < 2:
            raise ValueError(f"token limit {limit} is too small")
        self.tokenizer = tokenizer
        self.limit = int(limit)
        self.keep_head = int(keep_head)
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
        kept, cut = truncate_ids(ids, self.limit, self.keep_head)
        return PromptIds(kept, len(ids), cut)


# --------------------------------------------------------------------------------------
# Decision points: labels joined with trajectories
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ExtractPoint:
    """One decision point to extract: its label, its trajectory and P/O/R ranges."""

    label: DecisionPoint
    trajectory: Mapping[str, Any] = field(repr=False)
    context: DecisionContext

    @property
    def key(self) -> tuple[str, int]:
        return (self.label.trajectory_id, self.label.message_index)

    def full_messages(self) -> list[Mapping[str, Any]]:
        """The context as served: ``messages[:i]`` (P + O + R)."""
        return list(self.trajectory["messages"][: self.context.message_index])

    def recent2_messages(self) -> list[Mapping[str, Any]]:
        """P + R_t: the prefix and the most recent blocks."""
        messages = self.trajectory["messages"]
        c = self.context
        return list(messages[: c.prefix_end]) + list(messages[c.old_end : c.message_index])


def _no_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    return 0  # only the P/O/R ranges are needed, not tokens(O)


def join_points(
    labels: Iterable[DecisionPoint], trajectories: Sequence[Mapping[str, Any]], n_recent: int = 2
) -> list[ExtractPoint]:
    """Each label with its trajectory (by id) and its decision context (by
    message index), ordered by trajectory (order of ``trajectories``) and step.
    A label whose trajectory or decision point is missing, or whose context
    differs (other ``n_recent``, other data), is an error."""
    by_id: dict[str, Mapping[str, Any]] = {}
    order: dict[str, int] = {}
    for given in trajectories:
        tid = str(given.get("id", ""))
        if tid not in by_id:
            by_id[tid] = given
            order[tid] = len(order)
    settings = AnnotatorSettings(n_recent=n_recent)
    contexts: dict[str, dict[int, DecisionContext]] = {}
    points: list[ExtractPoint] = []
    seen: set[tuple[str, int]] = set()
    missing: set[str] = set()
    for label in labels:
        trajectory = by_id.get(label.trajectory_id)
        if trajectory is None:
            missing.add(label.trajectory_id)
            continue
        if label.trajectory_id not in contexts:
            contexts[label.trajectory_id] = {
                c.message_index: c for c in decision_contexts(trajectory, _no_tokens, settings)
            }
        ctx = contexts[label.trajectory_id].get(label.message_index)
        where = f"label {label.trajectory_id}#{label.message_index}"
        if ctx is None:
            raise ExtractError(f"{where}: message {label.message_index} is not a decision point of the trajectory")
        if (ctx.step, ctx.n_old_blocks) != (label.step, label.n_old_blocks):
            raise ExtractError(
                f"{where}: step/old blocks {label.step}/{label.n_old_blocks} in the labels, "
                f"{ctx.step}/{ctx.n_old_blocks} here (labels made with another --n-recent or other data?)"
            )
        if (label.trajectory_id, label.message_index) in seen:
            raise ExtractError(f"{where}: labelled twice")
        seen.add((label.trajectory_id, label.message_index))
        points.append(ExtractPoint(label, trajectory, ctx))
    if missing:
        names = ", ".join(sorted(missing)[:5]) + (" ..." if len(missing) > 5 else "")
        raise ExtractError(f"{len(missing)} labelled trajectories are not in the data: {names}")
    points.sort(key=lambda p: (order[p.label.trajectory_id], p.label.step))
    return points


def select_points(
    points: Sequence[ExtractPoint], limit: int | None = None, subsample: float | None = None, seed: int = 0
) -> list[ExtractPoint]:
    """``subsample``: a fraction (0 < x < 1) or a count (x >= 1) of the points,
    drawn without replacement with ``seed``; then the first ``limit``. The
    order (trajectory, step) is kept, so the prefix cache still helps."""
    chosen = list(points)
    if subsample is not None:
        if subsample <= 0:
            raise ValueError("--subsample must be positive")
        count = round(subsample * len(chosen)) if subsample < 1 else int(subsample)
        if count < len(chosen):
            keep = np.random.default_rng(seed).choice(len(chosen), size=count, replace=False)
            chosen = [chosen[i] for i in sorted(keep.tolist())]
    if limit is not None:
        chosen = chosen[: max(0, int(limit))]
    return chosen


def points_digest(points: Sequence[ExtractPoint]) -> str:
    """Identifies the planned points and their labels (resume safety)."""
    digest = hashlib.sha256()
    for p in points:
        row = [p.label.trajectory_id, p.label.message_index, p.label.recall, p.label.compression]
        digest.update(json.dumps(row).encode() + b"\n")
    return digest.hexdigest()


def point_metadata(point: ExtractPoint, full: PromptIds, recent2: PromptIds) -> dict[str, Any]:
    """One JSON line: the point, its token counts, and its labels."""
    label = point.label
    return {
        "trajectory_id": label.trajectory_id,
        "source": label.source,
        "step": label.step,
        "message_index": label.message_index,
        "full_tokens": len(full.ids),
        "recent2_tokens": len(recent2.ids),
        "truncated": full.truncated,
        "recent2_truncated": recent2.truncated,
        "context_tokens": full.context_tokens,
        "recent2_context_tokens": recent2.context_tokens,
        "n_old_blocks": label.n_old_blocks,
        "old_tokens": label.old_tokens,
        "turn": label.turn,
        "last_tool": label.last_tool,
        "recall": label.recall,
        "compression": label.compression,
        "annotator": label.annotator,
    }


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


@dataclass
class ExtractResult:
    out_dir: Path
    points: int
    shards: int
    computed_shards: int = 0
    skipped_shards: int = 0
    computed_points: int = 0
    engine_start_s: float = 0.0
    extract_s: float = 0.0
    """Time spent on shards that were computed (tokenizing, engine, writing)."""

    @property
    def states_per_s(self) -> float:
        return 2 * self.computed_points / self.extract_s if self.extract_s > 0 else 0.0


def run_manifest(
    points: Sequence[ExtractPoint], prompter: ChatPrompter, shard_size: int, **settings: Any
) -> dict[str, Any]:
    """What a run is made of; a directory only resumes the same run."""
    return {
        "format": FORMAT,
        "points": len(points),
        "points_digest": points_digest(points),
        "shard_size": int(shard_size),
        "shards": math.ceil(len(points) / shard_size) if points else 0,
        "token_limit": prompter.limit,
        "keep_head": head_size(prompter.limit, prompter.keep_head),
        "tools_as_text": prompter.tools_as_text,
        **settings,
    }


def extract(
    points: Sequence[ExtractPoint],
    out_dir: str | Path,
    prompter: ChatPrompter,
    engine: CaptureEngine | Callable[[], CaptureEngine],
    *,
    shard_size: int = SHARD_SIZE,
    settings: Mapping[str, Any] | None = None,
    progress: bool = True,
    layers: Sequence[int] | None = None,
) -> ExtractResult:
    """Write the states of ``points`` into ``out_dir`` shard by shard, skipping
    complete shards. ``engine`` is an open ``CaptureEngine`` (the caller closes
    it) or a factory, called only when a shard needs work (closed here).
    ``settings`` (model, dtype, ...) go into the manifest. ``layers``: the
    blocks the engine taps (its ``layers``); their states of the full context
    are stored too."""
    from tqdm import tqdm

    if shard_size < 1:
        raise ValueError("shard_size must be at least 1")
    out_dir = Path(out_dir)
    layers = sorted(set(int(b) for b in layers)) if layers else []
    settings = dict(settings or {})
    if layers:
        settings["layers"] = tap_names(layers)  # only then: older directories still resume
    manifest = run_manifest(points, prompter, shard_size, **settings)
    open_run(out_dir, manifest)
    shards = [list(points[i : i + shard_size]) for i in range(0, len(points), shard_size)]
    result = ExtractResult(out_dir=out_dir, points=len(points), shards=len(shards))
    todo = [i for i, shard in enumerate(shards) if not shard_complete(out_dir, i, [p.key for p in shard], bool(layers))]
    result.skipped_shards = len(shards) - len(todo)
    if not todo:
        return result

    owned = not isinstance(engine, CaptureEngine)
    live = engine if isinstance(engine, CaptureEngine) else None
    done_states = 2 * sum(len(shards[i]) for i in range(len(shards)) if i not in todo)
    bar = tqdm(total=2 * len(points), initial=done_states, unit="state", desc="extracting", disable=not progress)
    try:
        for index in todo:
            shard = shards[index]
            if live is None:
                bar.set_postfix_str("starting the engine")
                started = time.monotonic()
                assert not isinstance(engine, CaptureEngine)  # live is None only for a factory
                live = engine()
                result.engine_start_s = time.monotonic() - started
                bar.set_postfix_str("")
            if prompter.limit > live.max_model_len - 1:
                raise ExtractError(
                    f"token limit {prompter.limit} does not fit the engine's window {live.max_model_len}"
                )
            if list(live.layers) != layers:
                raise ExtractError(f"the engine taps blocks {live.layers}, the run asks for {layers}")
            started = time.monotonic()
            prompts = [(prompter(p.full_messages()), prompter(p.recent2_messages())) for p in shard]
            ids = [x.ids for pair in prompts for x in pair]  # full_t, recent2_t, full_t+1, ...
            records = live.records(ids, on_state=lambda _slot: bar.update(1))
            states = np.stack([r.hidden_state() for r in records]).astype(np.float32)
            tensors = {"full": states[0::2], "recent2": states[1::2]}
            if layers:
                taps = np.stack([r.layer_states() for r in records[0::2]])  # [n, 2, taps, d]
                tensors["layers_last"], tensors["layers_mean"] = taps[:, 0], taps[:, 1]
            meta = [point_metadata(p, full, recent2) for p, (full, recent2) in zip(shard, prompts)]
            write_shard(out_dir, index, tensors, meta)
            result.extract_s += time.monotonic() - started
            result.computed_shards += 1
            result.computed_points += len(shard)
    finally:
        bar.close()
        if owned and live is not None:
            live.close()
    return result
