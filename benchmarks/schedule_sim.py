"""The engine-free model of a policy's serving cost and evidence
(``vllm_pamer/replay/schedule_model.py``), for choosing schedule settings in
seconds before measuring them on a server. Printed: one line per policy;
measured figures come from ``benchmarks/policies.py`` (benchmarks/RESULTS.md
compares the two).

    .venv/bin/python -m benchmarks.schedule_sim --kind swe --n 8 --max-steps 30
    .venv/bin/python -m benchmarks.schedule_sim --kind swe --split tuning --pool 33 --n 33  # choose on tuning
    .venv/bin/python -m benchmarks.schedule_sim --kind tau --split tuning --n 52 --max-steps 0 --context-budget 3000
    .venv/bin/python -m benchmarks.schedule_sim --kind swe --offset 16 --pool 32 --n 32  # off the run's own
    .venv/bin/python -m benchmarks.schedule_sim --kind tau --n 12 --policies none,recent_k,pamer \\
        --options '{"pamer": {"target_share": 0.5, "band_share": 0.25}}'
"""

from __future__ import annotations

import argparse
import json
import random

from benchmarks._repo import DATA
from vllm_pamer.core.render import render_tools_as_text
from vllm_pamer.core.tokens import TokenCounter
from vllm_pamer.default_model import ensure_default_model
from vllm_pamer.replay.schedule_model import ModelSettings, simulate
from vllm_pamer.replay.variants import policy_options
from vllm_pamer.trajectories import in_split, load_trajectories


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("tau", "swe"), default="swe")
    parser.add_argument("--n", type=int, default=8, help="trajectories (the first N of the file, shuffled by --seed)")
    parser.add_argument(
        "--pool", type=int, default=16, help="mini-swe: draw from the first N, as benchmarks.policies --swe"
    )
    parser.add_argument(
        "--offset",
        type=int,
        default=0,
        help="skip the first N trajectories (16: settings chosen off the benchmark's own)",
    )
    parser.add_argument(
        "--split",
        choices=("tuning", "evaluation"),
        default=None,
        help="only the trajectories of this split (vllm_pamer/data/splits.json; default: all): choose on tuning",
    )
    parser.add_argument("--max-steps", type=int, default=30, help="first N requests of each trajectory (0: all)")
    parser.add_argument("--policies", default="recent_k,pamer")
    parser.add_argument("--options", default="{}", help="JSON: per policy, options over benchmarks.policies' own")
    parser.add_argument(
        "--side-by-side", type=int, default=1, help="sessions at a time, one request each in turn (kv_share)"
    )
    parser.add_argument(
        "--round-s", type=float, default=20.0, help="modelled seconds between a session's requests (kv_share)"
    )
    parser.add_argument("--vote-p", type=float, default=0.8, help="chance the heads vote compress")
    parser.add_argument("--window", type=int, default=8192)
    parser.add_argument(
        "--context-budget",
        type=int,
        default=None,
        help="the budget every request sets (X-Pamer-Context-Budget), e.g. 4096 (mini-swe's tight point): "
        "every policy with a budget at the same one (default: each policy's own)",
    )
    parser.add_argument(
        "--kv-usage", type=float, default=None, help="KV-cache usage (0-1) every request sees (default: unknown)"
    )
    parser.add_argument(
        "--kv-capacity", type=int, default=None, help="tokens the KV cache holds (kv_share; default: unknown)"
    )
    parser.add_argument("--block", type=int, default=128, help="KV block size (vLLM's CPU default)")
    parser.add_argument("--summary-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    counter = TokenCounter(AutoTokenizer.from_pretrained(str(ensure_default_model(quiet=True))), render_tools_as_text)
    name = "tau_airline" if args.kind == "tau" else "mini_swe"
    loaded = in_split(load_trajectories(DATA / f"{name}.jsonl.gz"), args.split)
    loaded = loaded[args.offset :]
    pool = loaded[: args.pool] if args.kind == "swe" else loaded
    trajectories = random.Random(args.seed).sample(pool, len(pool))[: args.n]
    known, extra = policy_options(args.summary_tokens), json.loads(args.options)
    fields = ModelSettings.__struct_fields__
    settings = ModelSettings(**{k: v for k, v in vars(args).items() if k in fields})
    for policy in args.policies.split(","):
        options = {**known.get(policy, {}), **extra.get(policy, {})}
        print(policy, json.dumps(simulate(policy, options, trajectories, settings, counter)), flush=True)


if __name__ == "__main__":
    main()
