"""One policy through the Responses API and through chat completions, on the
same trajectories and one server (issue 34: the prefill a policy computes
should not depend on the API the agent speaks).

    .venv/bin/python -m benchmarks.apis --tau 4 --swe 2 --policy pamer --context-budget tau=3000,swe=4096

Each API replays every trajectory in turn (each its own session; the Responses
API gets the whole history as input items each step, ``store`` false), from an
empty prefix cache. Printed per API: requests answered, actions, prompt tokens
computed (vLLM's ``prompt_tokens_by_source`` local compute) and read from the
cache; then the ratio of the Responses API's prefill to chat's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
from pathlib import Path

from benchmarks._repo import DATA
from vllm_pamer.default_model import ensure_default_model, shipped_heads
from vllm_pamer.replay.client import ReplaySettings, connect, parse_budgets, plan_replay, replay_policy
from vllm_pamer.replay.own_server import start_server
from vllm_pamer.replay.variants import policy_options
from vllm_pamer.trajectories import in_split, load_trajectories

APIS = ("chat", "responses")


def computed(deltas: dict[str, float]) -> tuple[float, float]:
    """(prompt tokens computed, read from the prefix cache) of one run's metric deltas."""
    local = sum(v for k, v in deltas.items() if "prompt_tokens_by_source" in k and 'source="local_compute"' in k)
    cached = sum(v for k, v in deltas.items() if "prompt_tokens_by_source" in k and 'source="local_cache_hit"' in k)
    return local, cached


async def run(args: argparse.Namespace, url: str, plans) -> dict[str, tuple]:
    results = {}
    for api in APIS:
        settings = ReplaySettings(
            url=url,
            max_tokens=args.max_tokens,
            concurrency=args.concurrency,
            reset_prefix_cache=True,
            context_budget=parse_budgets(args.context_budget) if args.context_budget else None,
            api=api,
        )
        async with connect(settings) as (client, model):
            records, summary = await replay_policy(client, settings, model, args.policy, plans)
        results[api] = (records, summary)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tau", type=int, default=4, help="tau-bench trajectories (evaluation split)")
    parser.add_argument("--swe", type=int, default=2, help="mini-swe trajectories (evaluation split)")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--policy", default="pamer")
    parser.add_argument("--context-budget", default="tau=3000,swe=4096")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--summary-tokens", type=int, default=96)
    args = parser.parse_args()

    ensure_default_model(quiet=True)
    heads = shipped_heads()
    if heads is None:
        sys.exit("no shipped heads")
    chosen = []
    for name, count in (("tau_airline", args.tau), ("mini_swe", args.swe)):
        chosen += in_split(load_trajectories(DATA / f"{name}.jsonl.gz"), "evaluation")[:count]
    plans = plan_replay(chosen, args.max_steps)
    log = Path(tempfile.mkdtemp(prefix="apis-")) / "server.log"
    server = start_server(
        heads, policy_options(args.summary_tokens), "--enforce-eager --enable-prompt-tokens-details", None, log
    )
    try:
        server.wait_ready(timeout=900, progress=False)
        results = asyncio.run(run(args, server.base_url, plans))
    finally:
        server.stop()
    print(f"{args.policy}, {len(plans)} trajectories, {sum(len(p.steps) for p in plans)} requests per API")
    print("| API | answered | actions | prompt tokens computed | read from cache |\n|---|---|---|---|---|")
    local = {}
    for api, (records, summary) in results.items():
        answered = sum(r.status == "ok" for r in records)
        actions = collections.Counter(str((r.pamer or {}).get("action", r.status)).split(" ")[0] for r in records)
        local[api], cached = computed(summary.metric_deltas)
        shown = ", ".join(f"{k} {v}" for k, v in sorted(actions.items()))
        print(f"| {api} | {answered}/{len(records)} | {shown} | {local[api]:,.0f} | {cached:,.0f} |")
    print(f"prefill computed, responses / chat: {local['responses'] / local['chat']:.4f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
