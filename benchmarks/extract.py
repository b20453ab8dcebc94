"""State extraction: ``vllm-pamer extract`` (vLLM engine, batched, prefix cache)
vs a plain HF transformers ``output_hidden_states`` loop, on the same decision
points, the same token ids and the same model, in one run.

The decision points are those of the shipped samples (reference annotator):
``--select first`` (default) takes the first ``--points N`` in trajectory and
step order, as an extraction of whole trajectories runs them; ``--select
random`` draws N with ``--seed`` across all trajectories. The speed-up comes
from the prefix cache (``full_t`` is a prefix of ``full_t+1``), so it shrinks
where prompts share less: scattered steps, and full contexts cut to the window
(the cut keeps the first 2,048 tokens and the most recent rest, whose start
moves at every step). Both sides compute the
final-norm state of the last prompt token for the full context and for Recent2
(P + R_t), so 2 states per point:

* extractor: ``vllm_pamer.training.extract.extract`` into a fresh directory,
  exactly what ``vllm-pamer extract`` runs (tokenizing, the engine, writing the
  shards are all timed; engine start-up is reported separately);
* HF: ``AutoModelForCausalLM``, one prompt at a time,
  ``model.model(ids).last_hidden_state[0, -1]`` (the final-norm state), on the
  extractor's own token ids (tokenizing is not timed on this side), in the
  engine's dtype.

Prints states/s of both, the ratio, the cosine between the two outputs (mean
and min, per input), prompt tokens, the engine's prefix-cache hit rate, and
the load average (the machine may be shared).

    .venv/bin/python benchmarks/extract.py [--points 60] [--select first|random] [--seed 0] [--dtype auto]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def annotated_points(model_dir: Path):
    from vllm_pamer.training.annotate import create_annotator, tokenizer_counter
    from vllm_pamer.training.data import load_data
    from vllm_pamer.training.extract import join_points

    trajectories = load_data(None)
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
    parser.add_argument("--select", choices=("first", "random"), default="first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", help="engine dtype; HF runs in the engine's resolved dtype")
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    args = parser.parse_args()

    from vllm_pamer.adapters.launch import prepare_vllm_cpu

    prepare_vllm_cpu()
    from transformers import AutoTokenizer

    from vllm_pamer.default_model import ensure_default_model
    from vllm_pamer.model_config import model_max_len
    from vllm_pamer.offline_engine import CaptureEngine
    from vllm_pamer.training.data import load_states
    from vllm_pamer.training.extract import ChatPrompter, extract, select_points, token_limit

    model_dir = Path(args.model).resolve() if args.model else ensure_default_model(quiet=True)
    points = annotated_points(model_dir)
    if args.select == "random":
        points = select_points(points, subsample=args.points, seed=args.seed)
    else:
        points = select_points(points, limit=args.points)
    max_model_len = model_max_len(model_dir)
    prompter = ChatPrompter(AutoTokenizer.from_pretrained(model_dir), token_limit(max_model_len))
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
        torch_dtype = engine.llm.llm_engine.model_config.dtype
        with tempfile.TemporaryDirectory(prefix="pamer-bench-extract-") as out:
            result = extract(points, out, prompter, engine, shard_size=args.shard_size, progress=False)
            full, recent2, meta = load_states(out)
        hit_rate = prefix_cache_rate(engine.llm)
    finally:
        engine.close()  # free the cores before the HF loop

    # -- HF transformers, same ids ---------------------------------------------------
    prompts = []
    for p in points:
        prompts += [prompter(p.full_messages()).ids, prompter(p.recent2_messages()).ids]
    reference, hf_seconds = hf_states(model_dir, prompts, torch_dtype)
    load_after = os.getloadavg()

    n_states = 2 * len(points)
    ours = n_states / result.extract_s
    theirs = n_states / hf_seconds
    cos_full = cosine(full, reference[0::2])
    cos_recent = cosine(recent2, reference[1::2])
    tokens = sum(len(ids) for ids in prompts)
    print(f"model {model_dir.name}, dtype {torch_dtype}, max_model_len {max_model_len}, cpus {os.cpu_count()}")
    print(
        f"{len(points)} decision points ({args.select}, seed {args.seed}) from "
        f"{len({p.label.trajectory_id for p in points})} trajectories: {n_states} states, "
        f"{tokens} prompt tokens ({sum(m['truncated'] for m in meta)} full contexts cut to {prompter.limit})"
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
    print(f"cosine full    : mean {cos_full.mean():.5f}  min {cos_full.min():.5f}")
    print(f"cosine recent2 : mean {cos_recent.mean():.5f}  min {cos_recent.min():.5f}")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")


if __name__ == "__main__":
    main()
