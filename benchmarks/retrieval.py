"""Retrieval check: which embedder recalls the memory that holds a needed value?

Compares recall embedders on tau-bench airline trajectories (the shipped sample
by default, ``--data`` for the full shared set) by replaying PaMER's archiving
along each trajectory and asking, whenever the agent needs a value that only an
archived memory still holds, whether cosine Top-K recall would bring it back.

The check, precisely
--------------------
For every trajectory and every agent request t (``agent_requests``: the history
``messages[:i]`` before assistant message i):

1. Split (``split_conversation``): P = prefix (system + task), blocks; R = the
   last ``--retained`` (2) blocks, old = the blocks before R.
2. Archive: whenever >= ``--group`` (3) old blocks are not yet archived, they
   all become one new memory (blocks are stable across requests, so with one
   new block per request memories hold 3 consecutive blocks). The memory text
   is ``serialize_messages`` of its blocks capped to ``--memory-chars`` (2,000)
   characters from its beginning and end (``cap_head_and_tail``). This raw,
   truncated text is a STAND-IN for the LLM summary PaMER would write
   (a ``--summaries`` mode that summarizes with the served model is left for
   later). Archiving happens before recall at t, so a memory made at t is
   already recallable at t.
3. If t has >= ``--min-memories`` (2) memories, its candidate values are
   * every argument value of the trajectory's ``ground_truth_actions`` (the
     tool calls the task requires; origin "task"), and
   * every argument value of the tool calls in assistant message i, the
     agent's next message (origin "next"; a task value that appears anywhere
     in message i, text or call arguments, is also "next"),
   where values are the strings and numbers of ``kwargs`` flattened through
   lists and dicts (booleans and None dropped, integral floats written as
   ints), keeping those of >= ``--min-value-len`` (3) characters: reservation
   ids, user ids, flight numbers, dates, airport codes, payment ids, prices...
4. A candidate becomes a case (t, value) when it occurs (exact, case-sensitive
   substring) in at least one memory's text but NOT in serialize(P) or
   serialize(R): the agent can get it back only from memory. (The <= 2 old
   blocks not yet archived are also sent raw by PaMER; by default they do not
   disqualify a value, as the brief defines it; ``--exclude-old`` makes them
   disqualify it too.) The memories that contain the value are its relevant
   memories.
5. Query = ``serialize_messages(P[-1:] + R)``, last ``--query-chars``
   (30,000) characters - exactly PaMER's recall query (task + R).
   Memories are ranked by cosine(query, memory) descending, ties to the older
   memory (``cosine_top_k``'s order).

Per method: cases; hit@1 and hit@3 (a relevant memory is ranked first / in the
Top-3); MRR (1 / rank of the best-ranked relevant memory); hit@3 on the cases
with more than 3 memories (with <= 3 memories Top-3 returns them all, so hit@3
is 1 for every method there - read hit@1 and MRR). Baselines: "random" is the
exact expectation of a uniformly random ranking (hit@3 = 1 - C(n-r,3)/C(n,3)
for n memories of which r are relevant; hit@1 = r/n; MRR exact), "recency"
ranks the newest memories first. The 95% intervals resample whole trajectories
(cases of one trajectory are correlated). Embedding throughput is texts per
second over the deduplicated memory and query texts (model load or engine
start not included; shown separately).

Embedders:
* ``served`` - SmolLM2-135M-Instruct (the embedded default model), its
  final-norm hidden state at the last token of the text, exactly what
  ``EngineServices.embed`` returns: a real offline vLLM engine with our capture
  plugin, one ``llm.generate`` call over all texts with ``max_tokens=1`` and a
  capture key each, the states read from the capture channel.
* ``minilm`` - all-MiniLM-L6-v2 (``vllm_pamer.embedders.MiniLMEmbedder``).

Usage:
    python -m benchmarks.retrieval                       # shipped sample, both embedders
    python -m benchmarks.retrieval --data ../shared/data/trajectories/tau_airline.jsonl.gz \
        --out /tmp/retrieval_full.md [--limit 60]
    python -m benchmarks.retrieval --embedders minilm    # no vLLM engine
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.core.text import cap_head_and_tail, serialize_messages
from vllm_pamer.trajectories import agent_requests, load_trajectories


@dataclass(frozen=True)
class CheckConfig:
    group: int = 3
    retained: int = 2
    memory_chars: int = 2000
    query_chars: int = 30_000
    min_memories: int = 2
    min_value_len: int = 3
    exclude_old: bool = False


@dataclass
class Case:
    trajectory: str
    message_index: int
    """Index i of the assistant message the agent was about to write."""
    value: str
    origin: str
    """"next" (in the agent's next message) or "task" (only in ground_truth_actions)."""
    n_memories: int
    relevant: tuple[int, ...]
    """Ids (positions in the trajectory's memory list) of the memories holding the value."""
    query: str
    previous_request: list | None = None
    """The messages PaMER sent at the previous request (P, the un-archived old
    blocks and R, without the memory message it showed): the prompt whose
    captured state is the deferred query (``query_source="captured"``)."""


@dataclass
class TrajectoryCheck:
    trajectory: str
    memories: list[str] = field(default_factory=list)
    cases: list[Case] = field(default_factory=list)
    requests: int = 0
    evaluated_requests: int = 0


# -- case extraction (pure) ------------------------------------------------------------


def flatten_values(obj: Any, min_len: int = 3) -> list[str]:
    """String and number leaves of a JSON value (dict keys excluded), as text."""
    out: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, bool) or x is None:
            return
        elif isinstance(x, (int, float)):
            text = str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)
            if len(text) >= min_len:
                out.append(text)
        elif isinstance(x, str) and len(x.strip()) >= min_len:
            out.append(x.strip())

    walk(obj)
    return list(dict.fromkeys(out))


def task_values(trajectory: dict, min_len: int = 3) -> list[str]:
    return flatten_values([a.get("kwargs", {}) for a in trajectory.get("ground_truth_actions") or []], min_len)


def call_values(message: dict, min_len: int = 3) -> list[str]:
    """Argument values of a message's tool calls."""
    args = []
    for call in message.get("tool_calls") or []:
        raw = call.get("function", {}).get("arguments")
        try:
            args.append(json.loads(raw) if isinstance(raw, str) else raw)
        except json.JSONDecodeError:
            continue
    return flatten_values(args, min_len)


def memory_text(blocks, cfg: CheckConfig) -> str:
    return cap_head_and_tail(serialize_messages([m for b in blocks for m in b.messages]), cfg.memory_chars)


def check_trajectory(trajectory: dict, cfg: CheckConfig = CheckConfig()) -> TrajectoryCheck:
    """Replay archiving along one trajectory and extract its (t, value) cases."""
    messages = trajectory["messages"]
    out = TrajectoryCheck(trajectory=str(trajectory.get("id", "?")))
    gt = task_values(trajectory, cfg.min_value_len)
    archived = 0  # old blocks already in memories (always a prefix of the blocks)
    previous_request = None
    for i, history in agent_requests(messages):
        out.requests += 1
        conversation = split_conversation(history)
        blocks = conversation.blocks
        cut = max(0, len(blocks) - cfg.retained)
        old, recent = blocks[:cut], blocks[cut:]
        if len(old) - archived >= cfg.group:
            out.memories.append(memory_text(old[archived:], cfg))
            archived = len(old)
        prefix = list(conversation.prefix)
        sent_before, previous_request = previous_request, prefix + [m for b in blocks[archived:] for m in b.messages]
        if len(out.memories) < cfg.min_memories:
            continue
        out.evaluated_requests += 1
        recent_messages = [m for b in recent for m in b.messages]
        context = serialize_messages(prefix + recent_messages)
        if cfg.exclude_old:
            context += "\n" + serialize_messages([m for b in old[archived:] for m in b.messages])
        next_message = messages[i]
        next_text = serialize_messages([next_message])
        candidates: dict[str, str] = {v: "next" for v in call_values(next_message, cfg.min_value_len)}
        for v in gt:
            candidates.setdefault(v, "next" if v in next_text else "task")
        query = serialize_messages(prefix[-1:] + recent_messages)[-cfg.query_chars :]
        for value, origin in candidates.items():
            if value in context:
                continue
            relevant = tuple(k for k, text in enumerate(out.memories) if value in text)
            if relevant:
                out.cases.append(
                    Case(out.trajectory, i, value, origin, len(out.memories), relevant, query, sent_before)
                )
    return out


# -- ranking and metrics ---------------------------------------------------------------


def rank_memories(query: np.ndarray, memories: np.ndarray) -> list[int]:
    """Memory ids by cosine descending, ties to the lower id (cosine_top_k's order);
    zero vectors last."""
    q = np.asarray(query, dtype=np.float64)
    m = np.asarray(memories, dtype=np.float64)
    qn = np.linalg.norm(q)
    mn = np.linalg.norm(m, axis=1)
    scores = np.where((mn > 0) & (qn > 0), (m @ q) / np.maximum(mn * qn, 1e-300), -np.inf)
    return sorted(range(len(scores)), key=lambda k: (-scores[k], k))


def first_relevant_rank(order: Sequence[int], relevant: Sequence[int]) -> int:
    wanted = set(relevant)
    return next(pos for pos, k in enumerate(order, 1) if k in wanted)


def random_expectations(n: int, r: int, k: int = 3) -> tuple[float, float, float]:
    """Exact (hit@1, hit@k, MRR) of a uniformly random ranking of n memories, r relevant."""
    k = min(k, n)
    hit1 = r / n
    hitk = 1.0 - math.comb(n - r, k) / math.comb(n, k)
    total = math.comb(n, r)
    mrr = sum(math.comb(n - j, r - 1) / total / j for j in range(1, n - r + 2))
    return hit1, hitk, mrr


@dataclass
class MethodResult:
    name: str
    ranks: list[float]  # first relevant rank per case (nan for expectation rows)
    hit1: np.ndarray
    hit3: np.ndarray
    rr: np.ndarray


def score_method(name: str, cases: list[Case], order_of) -> MethodResult:
    hit1, hit3, rr, ranks = [], [], [], []
    for case in cases:
        rank = first_relevant_rank(order_of(case), case.relevant)
        ranks.append(rank)
        hit1.append(rank == 1)
        hit3.append(rank <= 3)
        rr.append(1.0 / rank)
    return MethodResult(name, ranks, np.array(hit1, float), np.array(hit3, float), np.array(rr, float))


def random_method(cases: list[Case]) -> MethodResult:
    rows = [random_expectations(c.n_memories, len(c.relevant)) for c in cases]
    arr = np.array(rows, float).reshape(-1, 3)
    return MethodResult("random (exact expectation)", [math.nan] * len(cases), arr[:, 0], arr[:, 1], arr[:, 2])


def bootstrap_ci(values: np.ndarray, groups: np.ndarray, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean, resampling whole groups (trajectories)."""
    if len(values) == 0:
        return math.nan, math.nan
    labels = np.unique(groups)
    index = [np.flatnonzero(groups == g) for g in labels]
    sums = np.array([values[ix].sum() for ix in index])
    counts = np.array([len(ix) for ix in index])
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(labels), size=(n_boot, len(labels)))
    means = sums[picks].sum(1) / counts[picks].sum(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


# -- embedders ---------------------------------------------------------------------------


class ServedStateEmbedder:
    """The served model's final-norm state at the last token (what
    EngineServices.embed returns), from a real offline vLLM engine with the
    capture plugin. Batch use only: one llm.generate over all texts."""

    name = "served"

    def __init__(
        self,
        model_dir: str | Path | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.15,
        capture_wait_s: float = 30.0,
    ) -> None:
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.capture_wait_s = capture_wait_s
        self.dim: int | None = None
        self.label = "served"
        self.llm = None

    def start(self) -> None:
        from vllm_pamer.adapters.launch import prepare_vllm_cpu

        prepare_vllm_cpu()
        import msgspec
        import zmq

        from vllm_pamer.channel import CHANNEL_ENV, CaptureRecord
        from vllm_pamer.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        model_dir = Path(self.model_dir) if self.model_dir else ensure_default_model()
        self.label = f"served ({model_dir.name if self.model_dir else DEFAULT_MODEL_NAME} final-norm, last token)"
        self._sock_path = os.path.join(tempfile.gettempdir(), f"pamer-retrieval-{uuid.uuid4().hex[:10]}.sock")
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, 0)  # keep every record, however many
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"ipc://{self._sock_path}")
        self._decoder = msgspec.msgpack.Decoder(CaptureRecord)
        self._records: dict[str, np.ndarray] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

        from vllm import LLM

        saved = os.environ.get(CHANNEL_ENV)
        os.environ[CHANNEL_ENV] = f"ipc://{self._sock_path}"  # inherited by the engine
        try:
            kwargs = dict(
                model=str(model_dir),
                enforce_eager=True,
                gpu_memory_utilization=self.gpu_memory_utilization,
                seed=0,
            )
            if self.max_model_len:
                kwargs["max_model_len"] = self.max_model_len
            self.llm = LLM(**kwargs)
        finally:
            if saved is None:
                os.environ.pop(CHANNEL_ENV, None)
            else:
                os.environ[CHANNEL_ENV] = saved
        self.tokenizer = self.llm.get_tokenizer()
        self.max_len = self.llm.llm_engine.model_config.max_model_len

    def _drain(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(100):
                record = self._decoder.decode(self._socket.recv())
                if record.key:
                    with self._cond:
                        self._records[record.key] = record.hidden_state().copy()
                        self._cond.notify_all()

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        from vllm import SamplingParams, TokensPrompt

        from vllm_pamer.channel import CAPTURE_KEY

        prompts, params, keys = [], [], []
        for text in texts:
            # as EngineServices.embed: no special tokens, keep the end of the text
            ids = self.tokenizer.encode(text, add_special_tokens=False)[-(self.max_len - 2) :] or [0]
            key = uuid.uuid4().hex
            keys.append(key)
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            params.append(SamplingParams(temperature=0.0, max_tokens=1, extra_args={CAPTURE_KEY: key}))
        self.llm.generate(prompts, params, use_tqdm=True)
        deadline = time.monotonic() + self.capture_wait_s
        with self._cond:
            while any(k not in self._records for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sum(k not in self._records for k in keys)
                    raise RuntimeError(f"{missing} of {len(keys)} embedding requests were not captured")
                self._cond.wait(left)
            rows = [self._records.pop(k) for k in keys]
        out = np.stack(rows).astype(np.float32)
        self.dim = out.shape[1]
        return out

    def close(self) -> None:
        if self.llm is not None:
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
            self.llm = None
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close()
        try:
            os.unlink(self._sock_path)
        except OSError:
            pass


class _MiniLMRunner:
    def __init__(self) -> None:
        from vllm_pamer.embedders import make_embedder

        self.embedder = make_embedder("minilm")
        self.label = "minilm (all-MiniLM-L6-v2, mean pool)"
        self.dim: int | None = None

    def start(self) -> None:
        self.embedder.load()

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        chunk = 64
        parts = [
            self.embedder.embed_batch(texts[s : s + chunk])
            for s in tqdm(range(0, len(texts), chunk), desc="minilm", unit="batch")
        ]
        out = np.concatenate(parts) if parts else np.zeros((0, 384), np.float32)
        self.dim = out.shape[1]
        return out

    def close(self) -> None:
        pass


def captured_query_vectors(runner: ServedStateEmbedder, cases: list[Case]) -> dict[int, np.ndarray]:
    """Per case (by ``id``): the served state at the end of the previous
    request's prompt, rendered as the server renders it (chat template with
    the generation prompt, tool calls as text where the template has no
    tools): what ``query_source="captured"`` recalls with. Cases without a
    previous request are absent (the server falls back to the text query)."""
    from vllm_pamer.core.render import render_tools_as_text, template_supports_tools

    tokenizer = runner.tokenizer
    as_text = not template_supports_tools(getattr(tokenizer, "chat_template", None))
    prompts: dict[str, int] = {}
    of_case: dict[int, int] = {}
    for case in cases:
        if case.previous_request is None:
            continue
        messages = render_tools_as_text(case.previous_request) if as_text else case.previous_request
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        of_case[id(case)] = prompts.setdefault(text, len(prompts))
    vectors = runner.embed_batch(list(prompts)) if prompts else np.zeros((0, 1), np.float32)
    return {key: vectors[row] for key, row in of_case.items()}


def make_runner(name: str, args):
    if name == "served":
        return ServedStateEmbedder(args.model, args.max_model_len, args.gpu_memory_utilization)
    if name == "minilm":
        return _MiniLMRunner()
    raise SystemExit(f"unknown embedder {name!r} (served, minilm)")


# -- report -------------------------------------------------------------------------------


def fmt(x: float, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def build_report(
    args,
    checks: list[TrajectoryCheck],
    cases: list[Case],
    methods: list[MethodResult],
    speed: dict[str, dict[str, float]],
    labels: dict[str, str],
    dims: dict[str, int],
) -> str:
    groups = np.array([c.trajectory for c in cases])
    big = np.array([c.n_memories > 3 for c in cases], bool)
    nxt = np.array([c.origin == "next" for c in cases], bool)
    n_mem = [c.n_memories for c in cases]
    source = args.data or 'shipped sample (load_trajectories(kind="tau"))'
    lines = [
        "# Retrieval check: memory recall on tau-bench airline",
        "",
        f"data: `{source}`"
        + (
            f", {len(checks)} trajectories (random subset, --limit {args.limit}, seed {args.seed})"
            if args.limit
            else f", {len(checks)} trajectories"
        ),
        f"settings: group {args.group} blocks/memory, R = {args.retained} blocks, memory text = raw serialized blocks "
        f"capped to {args.memory_chars} chars (stand-in for a summary), "
        f"query = task + R (last {args.query_chars} chars), "
        f"requests with >= {args.min_memories} memories, values >= {args.min_value_len} chars"
        + (", values in un-archived old blocks excluded" if args.exclude_old else ""),
        f"requests: {sum(c.requests for c in checks)}, evaluated (>= {args.min_memories} memories): "
        f"{sum(c.evaluated_requests for c in checks)}, "
        f"with >= 1 case: {len({(c.trajectory, c.message_index) for c in cases})}; "
        f"memories: {sum(len(c.memories) for c in checks)}",
        f"cases: {len(cases)} ({int(nxt.sum())} in the agent's next message, {int((~nxt).sum())} task-only); "
        f"with > 3 memories: {int(big.sum())}; "
        f"memories per case: mean {fmt(float(np.mean(n_mem)) if n_mem else math.nan, 2)}, "
        f"max {max(n_mem) if n_mem else 0}; relevant memories per case: mean "
        f"{fmt(float(np.mean([len(c.relevant) for c in cases])) if cases else math.nan, 2)}",
        "",
        "| method | dim | cases | hit@1 | hit@3 | MRR | MRR 95% CI | MRR, mean of trajectories | "
        "hit@3, > 3 memories | hit@1, next-message cases |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        lo, hi = bootstrap_ci(m.rr, groups)
        macro = float(np.mean([m.rr[groups == g].mean() for g in np.unique(groups)])) if len(cases) else math.nan
        lines.append(
            f"| {labels.get(m.name, m.name)} | {dims.get(m.name, '-')} | {len(cases)} | "
            f"{fmt(m.hit1.mean() if len(cases) else math.nan)} | "
            f"{fmt(m.hit3.mean() if len(cases) else math.nan)} | {fmt(m.rr.mean() if len(cases) else math.nan)} | "
            f"{fmt(lo)}-{fmt(hi)} | {fmt(macro)} ({len(np.unique(groups))} traj.) | "
            f"{fmt(m.hit3[big].mean() if big.any() else math.nan)} (n={int(big.sum())}) | "
            f"{fmt(m.hit1[nxt].mean() if nxt.any() else math.nan)} (n={int(nxt.sum())}) |"
        )
    by_name = {m.name: m for m in methods}
    for first, second in (("served", "minilm"), ("served", "served-captured")):
        if first not in by_name or second not in by_name:
            continue
        a, b = by_name[first], by_name[second]
        diff = b.rr - a.rr
        lo, hi = bootstrap_ci(diff, groups)
        lines += [
            "",
            f"MRR difference {b.name} - {a.name}: {fmt(float(diff.mean()) if len(cases) else math.nan)} "
            f"(95% CI {fmt(lo)} to {fmt(hi)}, trajectory bootstrap); cases where only {a.name} ranks a "
            f"relevant memory first: {int(((a.hit1 == 1) & (b.hit1 == 0)).sum())}, only {b.name}: "
            f"{int(((b.hit1 == 1) & (a.hit1 == 0)).sum())}",
        ]
    lines += ["", "| embedder | texts embedded | embed s | texts/s | load/start s |", "|---|---|---|---|---|"]
    for name, s in speed.items():
        lines.append(
            f"| {labels.get(name, name)} | {int(s['texts'])} | {fmt(s['seconds'], 1)} | "
            f"{fmt(s['texts'] / s['seconds'] if s['seconds'] > 0 else math.nan, 1)} | {fmt(s['start'], 1)} |"
        )
    lines += [
        "",
        "hit@3 is 1 for every method when a request has <= 3 memories; hit@1 and MRR carry the signal there.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="tau trajectories .jsonl[.gz] (default: the shipped sample)")
    parser.add_argument("--limit", type=int, help="use a random subset of this many trajectories")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--embedders", default="served,minilm", help="comma list of: served, minilm")
    parser.add_argument("--out", help="also write the markdown report here")
    parser.add_argument("--group", type=int, default=3, help="old blocks per memory")
    parser.add_argument("--retained", type=int, default=2, help="recent blocks R")
    parser.add_argument("--memory-chars", type=int, default=2000)
    parser.add_argument("--query-chars", type=int, default=30_000)
    parser.add_argument("--min-memories", type=int, default=2)
    parser.add_argument("--min-value-len", type=int, default=3)
    parser.add_argument("--exclude-old", action="store_true", help="values in un-archived old blocks are not cases")
    parser.add_argument("--model", help="served model dir (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    args = parser.parse_args(argv)

    cfg = CheckConfig(
        args.group,
        args.retained,
        args.memory_chars,
        args.query_chars,
        args.min_memories,
        args.min_value_len,
        args.exclude_old,
    )
    trajectories = [t for t in load_trajectories(args.data, kind="tau") if t.get("ground_truth_actions") is not None]
    if args.limit and args.limit < len(trajectories):
        rng = np.random.default_rng(args.seed)
        keep = sorted(rng.choice(len(trajectories), size=args.limit, replace=False).tolist())
        trajectories = [trajectories[k] for k in keep]
    checks = [check_trajectory(t, cfg) for t in tqdm(trajectories, desc="replaying", unit="traj")]
    cases = [c for ch in checks for c in ch.cases]
    by_traj = {ch.trajectory: ch for ch in checks}

    # the texts to embed: memories that some case ranks, and the queries of the cases
    texts: dict[str, int] = {}
    for ch in checks:
        if ch.cases:
            n = max(c.n_memories for c in ch.cases)
            for text in ch.memories[:n]:
                texts.setdefault(text, len(texts))
    for c in cases:
        texts.setdefault(c.query, len(texts))
    text_list = list(texts)
    print(f"{len(checks)} trajectories, {len(cases)} cases, {len(text_list)} distinct texts to embed", file=sys.stderr)

    methods: list[MethodResult] = []
    speed: dict[str, dict[str, float]] = {}
    labels: dict[str, str] = {"recency": "recency (newest memories first)"}
    dims: dict[str, int] = {}
    for name in [e.strip() for e in args.embedders.split(",") if e.strip()]:
        runner = make_runner(name, args)
        t0 = time.perf_counter()
        runner.start()
        started = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            vectors = runner.embed_batch(text_list) if text_list else np.zeros((0, 1), np.float32)
            seconds = time.perf_counter() - t1
            if name == "served" and cases:
                # the deferred query: the state captured at the previous request's prefill
                captured = captured_query_vectors(runner, cases)
        finally:
            runner.close()
        labels[name] = runner.label
        dims[name] = int(vectors.shape[1]) if len(text_list) else 0
        speed[name] = {"texts": len(text_list), "seconds": seconds, "start": started}

        def ranker(vectors=vectors, queries: dict[int, np.ndarray] | None = None):
            """Order of a case's memories by cosine to its query: the text
            query's vector, or ``queries[id(case)]`` where given."""

            def order_of(case: Case) -> list[int]:
                mem = np.stack([vectors[texts[t]] for t in by_traj[case.trajectory].memories[: case.n_memories]])
                query = (queries or {}).get(id(case))
                return rank_memories(vectors[texts[case.query]] if query is None else query, mem)

            return order_of

        methods.append(score_method(name, cases, ranker()))
        if name == "served" and cases:
            labels["served-captured"] = (
                f"{runner.label.replace('last token', 'previous request')}, "
                "query = captured state of the previous request's prompt"
            )
            dims["served-captured"] = dims[name]
            methods.append(score_method("served-captured", cases, ranker(queries=captured)))
    methods.append(score_method("recency", cases, lambda c: list(range(c.n_memories - 1, -1, -1))))
    methods.append(random_method(cases))

    report = build_report(args, checks, cases, methods, speed, labels, dims)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
