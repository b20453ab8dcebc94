"""Retrieval check: which embedder recalls the memory that holds a needed value?

Compares recall embedders on tau-bench airline trajectories (the shipped sample
by default, ``--data`` for the full shared set) by replaying PaMER's archiving
along each trajectory and asking, whenever the agent needs a value that only an
archived memory still holds, whether cosine Top-K recall would bring it back.

The check, its cases and metrics: ``vllm_pamer/replay/retrieval.py``.

Embedders:
* ``served`` - SmolLM2-135M-Instruct (the embedded default model), its
  final-norm hidden state at the last token of the text, exactly what
  ``EngineServices.embed`` returns: a real offline vLLM engine with our capture
  plugin (``vllm_pamer.offline_engine.CaptureEngine``), one ``llm.generate``
  call over all texts with ``max_tokens=1`` and a capture key each, the states
  read from the capture channel.
* ``minilm`` - all-MiniLM-L6-v2 (``vllm_pamer.embedders.MiniLMEmbedder``).

Usage:
    python -m benchmarks.retrieval                       # shipped sample, both embedders
    python -m benchmarks.retrieval --data ../shared/data/trajectories/tau_airline.jsonl.gz \
        --out /tmp/retrieval_full.md [--limit 60]
    python -m benchmarks.retrieval --embedders minilm    # no vLLM engine
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from vllm_pamer.replay.retrieval import (
    Case,
    CheckConfig,
    MethodResult,
    TrajectoryCheck,
    bootstrap_ci,
    captured_query_vectors,
    check_trajectory,
    random_method,
    rank_memories,
    score_method,
)
from vllm_pamer.trajectories import load_trajectories

# -- embedders ---------------------------------------------------------------------------


class ServedStateEmbedder:
    """The served model's final-norm state at the last token (what
    EngineServices.embed returns), from the one offline capture
    (``vllm_pamer.offline_engine.CaptureEngine``). Batch use only: one
    generate call over all texts."""

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
        self.engine = None

    def start(self) -> None:
        from vllm_pamer.default_model import DEFAULT_MODEL_NAME, ensure_default_model
        from vllm_pamer.offline_engine import CaptureEngine

        model_dir = Path(self.model_dir) if self.model_dir else ensure_default_model()
        self.label = f"served ({model_dir.name if self.model_dir else DEFAULT_MODEL_NAME} final-norm, last token)"
        self.engine = CaptureEngine(
            model_dir,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=True,
            capture_timeout_s=self.capture_wait_s,
            all_cpu_cores=False,  # the thread count RESULTS' figures were measured with (it changes bf16 rounding)
        )
        self.tokenizer = self.engine.get_tokenizer()

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        with tqdm(total=len(texts), desc="served", unit="text") as bar:
            out = self.engine.text_states(texts, on_state=lambda _slot: bar.update(1))
        self.dim = out.shape[1]
        return out

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


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
