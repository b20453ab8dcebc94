"""Prefill states for the memory heads: ``vllm-pamer extract``.

For every labelled decision point (``vllm-pamer annotate``), the served model's
final-norm state at the last prompt token, for two inputs (``--inputs``: both,
or ``full`` alone, which halves the work where only the server's input is
wanted: Recent2 prompts share only P with the others, so the cache serves little
of them):

* ``full``: the context as served, ``messages[:i]`` (P + O + R);
* ``recent2``: the paper's compact input P + R_t (the prefix and the
  ``n_recent`` (2) most recent blocks; ``decision_contexts`` gives the ranges).

The states come from the vLLM engine (``vllm_pamer.offline_engine``) through
the same capture path as serving (``vllm_pamer.worker.capture``: the rows
``compute_logits`` receives, published on the ZeroMQ channel): no second model
code path. Each prompt is one request with ``max_tokens=1`` tagged with a
capture key.

Token ids are what the server would send, cut to the probe's limit
(``prompts.py``).

Batching and prefix caching: the points are ordered by trajectory (data file
order) and step, and one shard's prompts go to the engine in one
``LLM.generate`` call, in that order (full_t, recent2_t, full_t+1, ...).
``full_t`` is a prefix of ``full_t+1`` (the generation prompt opens the next
assistant message; for cut prompts, while the cut has not moved), and every
prompt of a trajectory starts with P, so the prefix cache serves most of each
prompt.

Output (``--out DIR``): the states format of ``vllm_pamer.training.data``
(a manifest, then shards of ``full`` and ``recent2`` tensors, or ``full``
alone, and metadata lines). A run skips the shards that are complete for its points (resume); a
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
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_pamer.offline_engine import CaptureEngine
from vllm_pamer.training.annotate import AnnotatorSettings, DecisionContext, DecisionPoint, decision_contexts
from vllm_pamer.training.data import FORMAT, STATE_NAMES, open_run, shard_complete, shard_dtype, write_shard
from vllm_pamer.training.prompts import ChatPrompter, PromptIds, head_size
from vllm_pamer.worker.layer_taps import tap_names

SHARD_SIZE = 256
"""Decision points per shard (one ``LLM.generate`` call of their prompts, one per input)."""


class ExtractError(RuntimeError):
    """The labels do not fit the data, or the engine does not fit the run."""


# -- Decision points: labels joined with trajectories ------------------------------------


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

    def messages(self, name: str) -> list[Mapping[str, Any]]:
        """The input ``name`` (``STATE_NAMES``) of the point."""
        return self.full_messages() if name == "full" else self.recent2_messages()


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


def select_trajectories(points: Sequence[ExtractPoint], count: int, seed: int = 0) -> list[ExtractPoint]:
    """Every point of trajectories drawn with ``seed`` until ``count`` points
    are taken, in the points' own (data, step) order."""
    sizes = Counter(p.label.trajectory_id for p in points)
    ids = sorted(sizes)
    taken: set[str] = set()
    total = 0
    for index in np.random.default_rng(seed).permutation(len(ids)):
        if total >= count:
            break
        taken.add(ids[index])
        total += sizes[ids[index]]
    return [p for p in points if p.label.trajectory_id in taken]


def cache_work_ratio(
    prompts: Sequence[Sequence[int]], trajectories: Sequence[str], config: Any, block: int
) -> tuple[float, float]:
    """(the operations of a plain forward of every prompt / the extractor's,
    share of the tokens the cache serves) on the same prompts, in the
    extractor's order (``benchmarks/extract.py`` measures it in seconds). Per
    position: 2 x the decoder's weights (linear layers) plus 4 x layers x
    hidden x position (attention scores and values). The extractor skips the
    whole KV blocks (``block`` tokens, the engine's ``block_size``) a prompt
    shares with the trajectory's previous one (the prefix cache), short of its
    last token, which is always computed."""
    config = getattr(config, "text_config", None) or config
    hidden, layers = config.hidden_size, config.num_hidden_layers
    kv = hidden // config.num_attention_heads * getattr(config, "num_key_value_heads", config.num_attention_heads)
    weights = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * config.intermediate_size)

    def work(start: int, end: int) -> float:  # positions start..end-1
        return 2 * weights * (end - start) + 4 * layers * hidden * (end * (end - 1) - start * (start - 1)) / 2

    ours = theirs = 0.0
    served = total = 0
    previous: tuple[str, Sequence[int]] | None = None
    for ids, trajectory in zip(prompts, trajectories, strict=True):
        shared = 0
        if previous is not None and previous[0] == trajectory:
            bound = min(len(ids), len(previous[1]))
            while shared < bound and ids[shared] == previous[1][shared]:
                shared += 1
        shared = min(shared, len(ids) - 1) // block * block
        ours += work(shared, len(ids))
        theirs += work(0, len(ids))
        served, total = served + shared, total + len(ids)
        previous = (trajectory, ids)
    return theirs / ours, served / total


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


# -- The run -----------------------------------------------------------------------------


@dataclass
class ExtractResult:
    out_dir: Path
    points: int
    shards: int
    computed_shards: int = 0
    skipped_shards: int = 0
    computed_points: int = 0
    inputs: int = len(STATE_NAMES)
    """States per point."""
    engine_start_s: float = 0.0
    extract_s: float = 0.0
    """Time spent on shards that were computed (tokenizing, engine, writing)."""

    @property
    def left(self) -> int:
        """Shards left for a later sitting (``stop_after_s``)."""
        return self.shards - self.computed_shards - self.skipped_shards

    @property
    def states_per_s(self) -> float:
        return self.inputs * self.computed_points / self.extract_s if self.extract_s > 0 else 0.0


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
        **({"cut_stride": prompter.cut_stride} if prompter.cut_stride else {}),  # 0 (cut at every step) as before
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
    inputs: Sequence[str] = STATE_NAMES,
    stop_after_s: float | None = None,
) -> ExtractResult:
    """Write the states of ``points`` into ``out_dir`` shard by shard, skipping
    complete shards. ``engine`` is an open ``CaptureEngine`` (the caller closes
    it) or a factory, called only when a shard needs work (closed here).
    ``settings`` (model, dtype, ...) go into the manifest. ``layers``: the
    blocks the engine taps (its ``layers``); their states of the full context
    are stored too. ``inputs``: ``STATE_NAMES``, or ``("full",)`` alone.
    ``stop_after_s``: start no new shard after that many seconds (a sitting;
    at least one shard is computed): the same call later resumes."""
    from tqdm import tqdm

    if shard_size < 1:
        raise ValueError("shard_size must be at least 1")
    out_dir = Path(out_dir)
    layers = sorted(set(int(b) for b in layers)) if layers else []
    settings = dict(settings or {})
    inputs = tuple(inputs)
    if inputs not in (STATE_NAMES, ("full",)):
        raise ValueError(f"inputs must be {STATE_NAMES} or ('full',), not {inputs}")
    if layers:
        settings["layers"] = tap_names(layers)  # only then: older directories still resume
    if inputs != STATE_NAMES:
        settings["inputs"] = list(inputs)  # the same
    manifest = run_manifest(points, prompter, shard_size, **settings)
    open_run(out_dir, manifest)
    shards = [list(points[i : i + shard_size]) for i in range(0, len(points), shard_size)]
    result = ExtractResult(out_dir=out_dir, points=len(points), shards=len(shards), inputs=len(inputs))
    todo = [
        i
        for i, shard in enumerate(shards)
        if not shard_complete(out_dir, i, [p.key for p in shard], bool(layers), inputs)
    ]
    result.skipped_shards = len(shards) - len(todo)
    if not todo:
        return result

    owned = not isinstance(engine, CaptureEngine)
    live = engine if isinstance(engine, CaptureEngine) else None
    done_dtypes = {shard_dtype(out_dir, i) for i in range(len(shards)) if i not in todo}
    done_states = len(inputs) * sum(len(shards[i]) for i in range(len(shards)) if i not in todo)
    total = len(inputs) * len(points)
    bar = tqdm(total=total, initial=done_states, unit="state", desc="extracting", disable=not progress)
    began = time.monotonic()
    try:
        for index in todo:
            if stop_after_s is not None and index != todo[0] and time.monotonic() - began >= stop_after_s:
                break
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
            if done_dtypes - {live.dtype}:  # `--dtype auto` resolves per machine (data.py)
                done = ", ".join(sorted(d or "a dtype not recorded" for d in done_dtypes))
                raise ExtractError(f"{out_dir}: shards done in {done}, this engine runs {live.dtype} (see --dtype)")
            started = time.monotonic()
            # both inputs' token counts go into the metadata (the length control reads them), extracted or not
            prompts = [{name: prompter(p.messages(name)) for name in STATE_NAMES} for p in shard]
            ids = [point[name].ids for point in prompts for name in inputs]  # full_t, recent2_t, full_t+1, ...
            records = live.records(ids, on_state=lambda _slot: bar.update(1))
            states = np.stack([r.hidden_state() for r in records]).astype(np.float32)
            tensors = {name: states[k :: len(inputs)] for k, name in enumerate(inputs)}
            if layers:
                taps = np.stack([r.layer_states() for r in records[0 :: len(inputs)]])  # [n, 2, taps, d]
                tensors["layers_last"], tensors["layers_mean"] = taps[:, 0], taps[:, 1]
            meta = [point_metadata(p, point["full"], point["recent2"]) for p, point in zip(shard, prompts)]
            write_shard(out_dir, index, tensors, meta, dtype=live.dtype)
            result.extract_s += time.monotonic() - started
            result.computed_shards += 1
            result.computed_points += len(shard)
    finally:
        bar.close()
        if owned and live is not None:
            live.close()
    return result
