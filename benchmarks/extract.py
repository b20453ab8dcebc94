"""State extraction: ``vllm-pamer extract`` (vLLM engine, batched, prefix cache)
vs a plain HF transformers ``output_hidden_states`` loop, on the same decision
points, the same token ids and the same model, in one run.

The decision points are those of the shipped samples, or of ``--data``
(reference annotator):
``--select first`` (default) takes the first ``--points N`` in trajectory and
step order; ``--select trajectories`` takes whole trajectories drawn with
``--seed`` from all of them until N points are taken, in data order, as an
extraction of every point runs them (the representative sample of both
sources); ``--select random`` draws N points with ``--seed``. The speed-up
comes from the prefix cache (``full_t`` is a prefix of ``full_t+1``), so it
shrinks where prompts share less: scattered steps, and full contexts cut to
the window (the cut keeps the first 2,048 tokens and the newest rest, moved in
steps of ``--cut-stride`` of that rest; 0: at every step). Both sides compute the
final-norm state of the last prompt token for the full context and for Recent2
(P + R_t), so 2 states per point (``--inputs full``: the full context alone):

* extractor: ``vllm_pamer.training.extract.extract`` into a fresh directory,
  exactly what ``vllm-pamer extract`` runs (tokenizing, the engine, writing the
  shards are all timed; engine start-up is reported separately);
* HF: ``AutoModelForCausalLM``, one prompt at a time,
  ``model.model(ids).last_hidden_state[0, -1]`` (the final-norm state), on the
  extractor's own token ids (tokenizing is not timed on this side), in the
  engine's dtype.

Prints states/s of both, the ratio, the cosine between the two outputs (mean
and min, per input), prompt tokens, the engine's prefix-cache hit rate, and
the load average (the machine may be shared); beside them a count of the
operations each side does on the same ids (``cache_work_ratio`` in
``vllm_pamer/training/extract.py``: the speed-up at equal operations per
second), which ``--count-only`` prints without starting either side.

    .venv/bin/python -m benchmarks.extract [--points 60] [--select first|trajectories|random] [--seed 0]
        [--data PATH ...] [--inputs full,recent2|full] [--cut-stride X] [--count-only]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def annotated_points(model_dir: Path, data: list[str] | None):
    from vllm_pamer.training.annotate import create_annotator, tokenizer_counter
    from vllm_pamer.training.data import load_data
    from vllm_pamer.training.extract import join_points

    trajectories = load_data(data)
    annotator = create_annotator("reference", count_tokens=tokenizer_counter(model_dir))
    labels = [p for t in trajectories for p in annotator.annotate(t)]
    return join_points(labels, trajectories)


def prefix_cache_rate(llm) -> float | None:
    try:
        values = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:prefix_cache_")}
        queries, hits = values.get("vllm:prefix_cache_queries"), values.get("vllm:prefix_cache_hits")
        return hits / queries if queries else None
    except Exception:
        return None


def hf_states(model_dir: Path, prompts: list[list[int]], dtype) -> tuple[np.ndarray, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    rows = []
    with torch.inference_mode():
        model.model(input_ids=torch.tensor([prompts[0][:16]]))  # warm-up
        started = time.perf_counter()
        for ids in prompts:
            out = model.model(input_ids=torch.tensor([ids]))
            rows.append(out.last_hidden_state[0, -1].float())
        seconds = time.perf_counter() - started
    return torch.stack(rows).numpy(), seconds


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=60)
    parser.add_argument("--select", choices=("first", "trajectories", "random"), default="first")
    parser.add_argument("--cut-stride", type=float, default=None, help="the extractor's (default: its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", help="engine dtype; HF runs in the engine's resolved dtype")
    parser.add_argument("--data", action="append", default=None, help="trajectories (default: the shipped samples)")
    parser.add_argument("--inputs", choices=("full,recent2", "full"), default="full,recent2")
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--count-only", action="store_true", help="print the operation count's ratio and stop")
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size for --count-only (a full run reads its engine's: 128 on vLLM's CPU backend)",
    )
    args = parser.parse_args()
    if args.count_only and args.block_size is None:
        parser.error("--count-only needs --block-size (no engine starts to read it from)")

    from vllm_pamer.adapters.launch import prepare_vllm_cpu

    prepare_vllm_cpu()
    from transformers import AutoConfig, AutoTokenizer

    from vllm_pamer.default_model import ensure_default_model
    from vllm_pamer.model_config import model_max_len
    from vllm_pamer.offline_engine import CaptureEngine
    from vllm_pamer.training.data import load_states
    from vllm_pamer.training.extract import cache_work_ratio, extract, select_points, select_trajectories
    from vllm_pamer.training.prompts import ChatPrompter, token_limit

    model_dir = Path(args.model).resolve() if args.model else ensure_default_model(quiet=True)
    points = annotated_points(model_dir, args.data)
    inputs = args.inputs.split(",")
    if args.select == "random":
        points = select_points(points, subsample=args.points, seed=args.seed)
    elif args.select == "trajectories":
        points = select_trajectories(points, args.points, args.seed)
    else:
        points = select_points(points, limit=args.points)
    max_model_len = model_max_len(model_dir)
    stride = {} if args.cut_stride is None else {"cut_stride": args.cut_stride}
    prompter = ChatPrompter(AutoTokenizer.from_pretrained(model_dir), token_limit(max_model_len), **stride)
    prompts = [prompter(p.messages(name)).ids for p in points for name in inputs]
    owners = [p.label.trajectory_id for p in points for _ in inputs]

    def counted(block: int) -> str:
        ratio, served = cache_work_ratio(prompts, owners, AutoConfig.from_pretrained(model_dir), block)
        return (
            f"operations : {ratio:.2f}x fewer on the extractor's side ({served:.1%} of the tokens served by the cache)"
        )

    if args.count_only:
        print(f"{len(points)} decision points from {len(set(owners))} trajectories, {sum(map(len, prompts))} tokens")
        print(counted(args.block_size))
        return
    load_before = os.getloadavg()

    # -- the extractor -------------------------------------------------------------
    started = time.monotonic()
    engine = CaptureEngine(
        model_dir,
        max_model_len=max_model_len,
        dtype=args.dtype,
        seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        disable_log_stats=False,
    )
    engine_start = time.monotonic() - started
    try:
        counted_line = counted(engine.block_size)
        torch_dtype = engine.llm.llm_engine.model_config.dtype
        with tempfile.TemporaryDirectory(prefix="pamer-bench-extract-") as out:
            result = extract(points, out, prompter, engine, shard_size=args.shard_size, progress=False, inputs=inputs)
            full, recent2, meta = load_states(out)
        hit_rate = prefix_cache_rate(engine.llm)
    finally:
        engine.close()  # free the cores before the HF loop

    # -- HF transformers, same ids ---------------------------------------------------
    reference, hf_seconds = hf_states(model_dir, prompts, torch_dtype)
    load_after = os.getloadavg()

    n_states = len(inputs) * len(points)
    ours = n_states / result.extract_s
    theirs = n_states / hf_seconds
    cosines = {"full": cosine(full, reference[0 :: len(inputs)])}
    if recent2 is not None:
        cosines["recent2"] = cosine(recent2, reference[1 :: len(inputs)])
    tokens = sum(len(ids) for ids in prompts)
    print(f"model {model_dir.name}, dtype {torch_dtype}, max_model_len {max_model_len}, cpus {os.cpu_count()}")
    print(
        f"{len(points)} decision points ({args.select}, seed {args.seed}) from "
        f"{len({p.label.trajectory_id for p in points})} trajectories: {n_states} states, "
        f"{tokens} prompt tokens ({sum(m['truncated'] for m in meta)} full contexts cut to {prompter.limit}, "
        f"cut stride {prompter.cut_stride:g})"
    )
    print(
        f"extractor : {result.extract_s:8.1f} s  {ours:7.2f} states/s   (engine start {engine_start:.1f} s, "
        f"prefix-cache hit rate {hit_rate if hit_rate is None else f'{hit_rate:.1%}'})"
    )
    print(f"HF loop   : {hf_seconds:8.1f} s  {theirs:7.2f} states/s")
    print(
        f"speed-up  : {ours / theirs:.2f}x  (with engine start-up: "
        f"{n_states / (result.extract_s + engine_start) / theirs:.2f}x)"
    )
    print(counted_line)
    for name, values in cosines.items():
        print(f"cosine {name:<8}: mean {values.mean():.5f}  min {values.min():.5f}")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")


if __name__ == "__main__":
    main()
