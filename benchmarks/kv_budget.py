"""What a small KV-cache budget costs, per policy: the same replay on (a) a
server with the default KV cache and (b) one with ``--small-kv-gib``, in
interleaved rounds a b b a (a linear drift of the machine cancels), each on a
freshly started server with the same flags. Prints each round, then per policy
the median steps / min of each side and the ratio b/a, with the prefill
computed, peak KV use and preemptions that explain it.

    .venv/bin/python -m benchmarks.kv_budget                           # 2 rounds, mini-swe, none + pamer
    .venv/bin/python -m benchmarks.kv_budget --rounds 2 --swe 4 --concurrency 4 --small-kv-gib 0.5

Workload: the first ``--swe`` mini-swe trajectories (``../shared`` data where it
exists, else the shipped sample), at most ``--max-steps`` requests each,
``--concurrency`` sessions at a time, as ``benchmarks/policies.py`` replays
them (prefix cache emptied before each policy). Long mini-swe contexts with
several sessions at a time are what a small budget cannot hold at once; a
policy that keeps contexts short should lose less. On a 2-core CPU the engine
is compute-bound, so this mostly shows the recomputed prefill; the question it
is built for (do shorter contexts buy throughput when KV memory binds) is a
GPU one, where the same command runs unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import msgspec

from benchmarks._repo import DATA
from benchmarks._rounds import interleaved_rounds
from vllm_pamer.default_model import ensure_default_model, shipped_heads
from vllm_pamer.replay.client import ReplaySettings, connect, plan_replay, replay_policy
from vllm_pamer.replay.own_server import start_server
from vllm_pamer.replay.records import PolicyRow
from vllm_pamer.replay.report import fmt, summarize
from vllm_pamer.replay.runs import KV_TOKENS_RE
from vllm_pamer.replay.variants import policy_options
from vllm_pamer.trajectories import load_or_sample

SIDES = ("a: default KV", "b: small KV")


async def one_round(url: str, policies: list[str], plans, args) -> dict[str, PolicyRow]:
    settings = ReplaySettings(
        url=url, max_tokens=args.max_tokens, concurrency=args.concurrency, reset_prefix_cache=True, progress=False
    )
    rows = {}
    async with connect(settings) as (client, model):
        warm_up = [
            msgspec.structs.replace(plans[0], steps=plans[0].steps[:1])
        ]  # a fresh server's first request is slow
        await replay_policy(client, settings, model, "none", warm_up)
        for policy in policies:
            records, run = await replay_policy(client, settings, model, policy, plans)
            rows[policy] = summarize(records, [run])[0]
    return rows


def print_ratios(results: dict[str, list[list[PolicyRow]]]) -> None:
    """Per policy: each side's steps / min and the ratio b/a, with what explains it."""
    print(
        "\n| policy | steps / min, a | steps / min, b | b/a (median of rounds) | b/a per round pair "
        "| prefill computed, a | prefill computed, b | peak KV, b | preemptions, b |"
    )
    print("|" + "---|" * 9)
    for policy, (a, b) in results.items():
        rate_a = statistics.median(r.steps_per_min for r in a)
        rate_b = statistics.median(r.steps_per_min for r in b)
        pairs = ", ".join(f"{rb.steps_per_min / ra.steps_per_min:.3f}" for ra, rb in zip(a, b))
        cells = [
            policy,
            fmt(rate_a, "rate"),
            fmt(rate_b, "rate"),
            f"{rate_b / rate_a:.3f}",
            pairs,
            fmt(statistics.median(r.prefill_computed or 0 for r in a)),
            fmt(statistics.median(r.prefill_computed or 0 for r in b)),
            fmt(max(r.peak_kv_usage or 0 for r in b), "pct"),
            fmt(max(r.preemptions or 0 for r in b)),
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="none,pamer")
    parser.add_argument(
        "--options",
        default="{}",
        help="JSON, per policy: options over the named variants' (vllm_pamer/replay/variants.py); a new name "
        'needs "policy" (e.g. {"pamer_s75": {"policy": "pamer", "kv_min_scale": 0.75}})',
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side (default %(default)s)")
    parser.add_argument("--swe", type=int, default=2, help="first N mini-swe trajectories")
    parser.add_argument("--max-steps", type=int, default=20, help="first N requests of each trajectory")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--summary-tokens", type=int, default=96, help="summary / cue / recall length")
    parser.add_argument(
        "--small-kv-gib",
        type=float,
        default=0.25,
        help="side b's KV cache (vLLM's --kv-cache-memory-bytes); it must hold one "
        "--max-model-len request (0.25 GiB: 11.6k tokens of the default model)",
    )
    parser.add_argument(
        "--sides", choices=("ab", "b"), default="ab", help="b: side b alone (a re-run; no ratio b/a is printed)"
    )
    parser.add_argument("--serve-args", default="--enforce-eager --enable-prompt-tokens-details")
    parser.add_argument(
        "--reference", default="recent_k", help="the policy every other one is compared with on side b (if replayed)"
    )
    args = parser.parse_args()

    ensure_default_model(quiet=True)
    heads = shipped_heads()
    if heads is None:
        sys.exit("no heads: ship trained heads (vllm-pamer train)")
    policies = [p for p in args.policies.split(",") if p]
    options = policy_options(args.summary_tokens)
    for name, extra in json.loads(args.options).items():  # a variant: its options over a known policy's
        options[name] = {**options.get(name, {}), **extra}
    plans = plan_replay(load_or_sample(DATA / "mini_swe.jsonl.gz", "swe")[: args.swe], args.max_steps)
    requests = sum(len(p.steps) for p in plans)
    budgets = (None, args.small_kv_gib)
    kv_tokens: list[set[str]] = [set(), set()]  # as each server reported its budget

    def start(side: int, log: Path):
        return start_server(heads, options, args.serve_args, budgets[side], log)

    def measure(side: int, server) -> dict[str, PolicyRow]:
        kv_tokens[side].update(KV_TOKENS_RE.findall(server.log_path.read_text(errors="replace")))
        return asyncio.run(one_round(server.base_url, policies, plans, args))

    def describe(side: int, rows: dict[str, PolicyRow]) -> str:
        return SIDES[side] + "".join(
            f"\n  {policy}: {row.answered}/{row.requests} answered, {fmt(row.steps_per_min, 'rate')} steps/min, "
            f"prefill computed {fmt(row.prefill_computed)}, peak KV {fmt(row.peak_kv_usage, 'pct')}, "
            f"preemptions {fmt(row.preemptions)}"
            for policy, row in rows.items()
        )

    sides = (0, 1) if args.sides == "ab" else (1,)
    by_side, logs = interleaved_rounds(args.rounds, start, measure, describe, "kv-budget-", sides)
    results = {p: [[rows[p] for rows in side] for side in by_side] for p in policies}
    if args.sides == "ab":
        print_ratios(results)

    if args.reference in results:
        reference = results[args.reference][1]
        ref_rate = statistics.median(r.steps_per_min for r in reference)
        ref_evidence = statistics.median(r.evidence_availability or 0 for r in reference)
        print(
            f"\nSide b against {args.reference} (answered steps / min: refused requests excluded; medians of rounds):\n"
            "| policy | answered / min, b | ratio | answered, b | evidence, b | evidence - reference | chars share, b |"
        )
        print("|" + "---|" * 7)
        for policy, (_, b) in results.items():
            rate = statistics.median(r.steps_per_min for r in b)
            evidence = statistics.median(r.evidence_availability or 0 for r in b)
            cells = [
                policy,
                fmt(rate, "rate"),
                f"{rate / ref_rate:.3f}",
                f"{b[0].answered}/{b[0].requests}",
                fmt(evidence, "pct"),
                fmt(evidence - ref_evidence, "pts"),
                fmt(statistics.median(r.chars_share or 0 for r in b), "pct"),
            ]
            print("| " + " | ".join(cells) + " |")
    print(
        f"\nworkload: {len(plans)} mini-swe trajectories, {requests} requests, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}; KV cache a: {'/'.join(sorted(kv_tokens[0])) or '?'} tokens, "
        f"b ({args.small_kv_gib} GiB): {'/'.join(sorted(kv_tokens[1])) or '?'} tokens; server logs in {logs}"
    )


if __name__ == "__main__":
    main()
