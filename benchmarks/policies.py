"""Every policy on recorded trajectories, side by side: one ``vllm-pamer
serve`` of the embedded model, the replay harness (``vllm_pamer.replay``) run
per group of trajectories and per policy, its report and plots written to
``--out`` (default benchmarks/results/policies/).

    .venv/bin/python -m benchmarks.policies --tau 3 --swe 1 --max-steps 10   # CPU-sized subsample, minutes
    .venv/bin/python -m benchmarks.policies --tau 0 --swe 8 --swe-max-steps 30 --group-size 8 \\
        --swe-group-size 4 --order random --concurrency 8 --stop-after-min 100 \\
        --out benchmarks/results/policies-full                                   # resumable, hours

Data: ../shared/data/trajectories/{tau_airline,mini_swe}.jsonl.gz, the first
``--tau`` / ``--swe`` trajectories of each (0 = all), at most ``--max-steps`` /
``--swe-max-steps`` requests each. Heads: the shipped trained heads of the
embedded model (or ``--heads``). Internal answers are shortened with
``--summary-tokens`` so a CPU run ends in hours, not days; say so when quoting.

Trajectories are split into groups of ``--group-size`` and every policy runs
on a group before the next group starts (prefix cache emptied before each
run), so a run stopped at any point still compares all policies on the same
trajectories. Each finished (group, policy) unit is saved in
``OUT/units.jsonl.gz`` (``vllm_pamer/replay/sittings.py``); running the same
command again resumes after the last saved unit (the settings must match;
``OUT/settings.json``). ``--stop-after-min``
starts no new unit after that many minutes, so a long run can be spread over
several sittings. The report covers the groups every policy finished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from pathlib import Path

from vllm_pamer.default_model import ensure_default_model, shipped_heads
from vllm_pamer.replay.client import ReplaySettings, TrajectoryPlan, plan_replay
from vllm_pamer.replay.sittings import (
    SettingsMismatch,
    UnitStore,
    check_settings,
    git_commit,
    kv_budget,
    make_groups,
    note_kv_budget,
    note_rerun,
    reruns,
    run_command,
    run_units,
    write_finished_report,
)
from vllm_pamer.server_process import ServerProcess
from vllm_pamer.trajectories import load_trajectories

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "trajectories"
POLICIES = "none,recent_k,pamer,pamer_tight,pamer_paper,sam"
TIGHT_BUDGET = 4096
"""The tight operating point's context budget: half the embedded model's window."""
RUN_OPTIONS = (
    "tau",
    "swe",
    "max_steps",
    "swe_max_steps",
    "order",
    "seed",
    "group_size",
    "swe_group_size",
    "concurrency",
    "max_tokens",
    "summary_tokens",
    "serve_args",
    "policies",
    "kv_cache_gib",
)
"""What a resumed run must repeat (settings.json)."""


def shared_or_shipped(name: str, kind: str) -> list[dict]:
    """The ``../shared`` trajectories ``name`` where they exist, else the
    shipped sample of that ``kind``."""
    path = DATA / f"{name}.jsonl.gz"
    return load_trajectories(path if path.exists() else None, kind=kind)


def policy_options(summary_tokens: int) -> dict[str, dict]:
    n = summary_tokens
    paper = {"policy": "pamer", "schedule": "paper", "summary_max_tokens": n, "summary_layout": "text"}
    return {
        "pamer": {"summary_max_tokens": n},  # the budget schedule at its defaults
        # the budget schedule with the paper's summary request (the old steps as one text)
        "pamer_text": {"policy": "pamer", "summary_max_tokens": n, "summary_layout": "text"},
        # the tight operating point: a context budget of half the window
        "pamer_tight": {"policy": "pamer", "summary_max_tokens": n, "context_budget": TIGHT_BUDGET},
        # the budget schedule as before 8ee507b under KV pressure: the vote compacts inside the
        # shrunk band and the summary resends the conversation
        "pamer_kv_vote": {
            "policy": "pamer",
            "summary_max_tokens": n,
            "vote_under_kv_pressure": True,
            "kv_pressure_summary_layout": "conversation",
        },
        # the budget held to each session's share of the KV cache (kv_share), so that the sessions'
        # contexts stay in the prefix cache together under a KV budget that binds
        "pamer_kv_share": {"policy": "pamer", "summary_max_tokens": n, "kv_share": 0.8},
        # and no engine request at a compaction under KV pressure: the memory is the record alone
        "pamer_kv_record": {"policy": "pamer", "summary_max_tokens": n, "kv_share": 0.8, "kv_pressure_summary": False},
        "pamer_paper": paper,  # the paper's schedule (Algorithm 1), what `pamer` was before the budget schedule
        "pamer_plus": {"summary_max_tokens": n, "recall_max_tokens": n},
        "periodic_summary": {"summary_max_tokens": n},
        "rolling_summary": {"summary_max_tokens": n},
        "sam": {"cue_max_tokens": n, "recall_max_tokens": n},
        # variants of the paper schedule measured in earlier runs
        "pamer_unstable": {**paper, "stable_recall": False},
        "pamer_conversation": {**paper, "summary_layout": "conversation"},
        "pamer_text_query": {**paper, "query_source": "text"},
    }


def load_plans(args: argparse.Namespace) -> tuple[list[TrajectoryPlan], list[TrajectoryPlan]]:
    """The tau-bench and mini-swe plans chosen by the options (first N, maybe shuffled)."""
    chosen = []
    for name, count, steps in (
        ("tau_airline", args.tau, args.max_steps),
        ("mini_swe", args.swe, args.swe_max_steps or args.max_steps),
    ):
        if count < 0:
            chosen.append([])
            continue
        loaded = load_trajectories(DATA / f"{name}.jsonl.gz")
        loaded = loaded if count == 0 else loaded[:count]
        if args.order == "random":
            loaded = random.Random(args.seed).sample(loaded, len(loaded))
        chosen.append(plan_replay(loaded, steps))
    return chosen[0], chosen[1]


def start_server(
    heads: str,
    options: dict,
    serve_args: str,
    kv_cache_gib: float | None,
    log: Path,
    kv_cache_blocks: int | None = None,
) -> ServerProcess:
    """The benchmark's ``vllm-pamer serve`` (not waited for): every policy
    selectable per request, a fresh memory store beside ``log``; the KV cache
    as vLLM sizes it, or ``kv_cache_gib``, or ``kv_cache_blocks`` blocks."""
    serve = [
        "--pamer-policy",
        "none",
        "--pamer-heads",
        str(heads),
        "--pamer-options-by-policy",
        json.dumps(options),
        "--pamer-allowed-policies",
        "*",
        *serve_args.split(),
    ]
    if kv_cache_gib is not None:
        serve += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    if kv_cache_blocks is not None:  # the same tokens on any machine (bytes per token differ by dtype)
        serve += ["--num-gpu-blocks-override", str(kv_cache_blocks)]
    # dev mode serves POST /reset_prefix_cache: each run starts from an empty
    # prefix cache, so "prefill computed" compares across policies
    env = {"PAMER_STORE": str(log.parent / "memory.sqlite3"), "VLLM_SERVER_DEV_MODE": "1"}
    # vLLM's CPU engine keeps a core for its scheduler unless told not to:
    # on 2 cores, letting it use both runs this replay faster
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return ServerProcess(serve, None, log, env=env)


def report(out: Path, groups, policies: list[str], commits: list[str], args: argparse.Namespace) -> None:
    """The report over the groups every policy finished."""

    def preface(finished: int, kinds: dict[str, int]) -> str:
        return (
            f"{finished} of {len(groups)} groups finished by all {len(policies)} policies: "
            f"{kinds['tau']} tau-bench and {kinds['swe']} mini-swe trajectories (at most "
            f"{args.max_steps or 'all'} / {args.swe_max_steps or args.max_steps or 'all'} requests each), "
            f"{args.concurrency} sessions at a time, {args.max_tokens} tokens generated per request, "
            f"summaries / cues / recalls <= {args.summary_tokens} tokens, KV cache of {kv_budget(out)} tokens. "
            f"Code: {', '.join(commits)}.{reruns(out)} "
            f"Command: `{run_command('benchmarks.policies', sys.argv[1:], ROOT)}`\n"
        )

    # the replayed trajectories, for the over-recency column (absent data: the column stays empty)
    paths = [DATA / f"{name}.jsonl.gz" for name in ("tau_airline", "mini_swe")]
    trajectories = [t for path in paths if path.exists() for t in load_trajectories(path)]
    write_finished_report(out, groups, policies, preface, trajectories, against=args.against)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--tau", type=int, default=4, help="first N tau-bench trajectories (0 = all, -1 = none)")
    parser.add_argument("--swe", type=int, default=1, help="first N mini-swe trajectories (0 = all, -1 = none)")
    parser.add_argument("--max-steps", type=int, default=None, help="first N requests of each trajectory")
    parser.add_argument("--swe-max-steps", type=int, default=None, help="for mini-swe (default: --max-steps)")
    parser.add_argument(
        "--order",
        choices=("first", "random"),
        default="first",
        help="group the chosen trajectories in file order or shuffled (--seed)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=4, help="trajectories per group (default %(default)s)")
    parser.add_argument("--swe-group-size", type=int, default=None, help="for mini-swe (default: --group-size)")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--summary-tokens", type=int, default=96, help="summary / cue / recall length")
    parser.add_argument("--heads", default=None)
    parser.add_argument("--serve-args", default="--enforce-eager --enable-prompt-tokens-details")
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="the KV-cache budget in GiB (vLLM's --kv-cache-memory-bytes, CPU or GPU). Small "
        "budgets and more --concurrency show what shorter contexts buy when KV memory is "
        "what limits the server",
    )
    parser.add_argument(
        "--kv-cache-blocks",
        type=int,
        default=None,
        help="hold the KV cache at this many blocks (vLLM's --num-gpu-blocks-override): a sitting on a "
        "machine that sizes the cache otherwise keeps the run's budget in tokens",
    )
    parser.add_argument(
        "--stop-after-min",
        type=float,
        default=None,
        help="start no new (group, policy) run after this many minutes; run again to resume",
    )
    parser.add_argument(
        "--rerun",
        default="",
        metavar="POLICIES",
        help="drop the saved units of these policies (comma-separated; their code changed) and run them "
        "again, first; settings.json records it",
    )
    parser.add_argument("--report-only", action="store_true", help="write the report from the saved units and exit")
    parser.add_argument(
        "--against",
        default=None,
        metavar="DIR",
        help="another run's --out (e.g. the same groups with more KV memory): the report adds "
        "steps / min here and there, per kind, on the groups both finished",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "policies"))
    args = parser.parse_args()

    ensure_default_model(quiet=True)
    heads = args.heads or shipped_heads()
    if heads is None:
        sys.exit("no heads: ship trained heads (vllm-pamer train) or pass --heads")
    policies = [p for p in args.policies.split(",") if p]
    options = policy_options(args.summary_tokens)
    out = Path(args.out)
    groups = make_groups(*load_plans(args), args.group_size, args.swe_group_size or args.group_size)
    fixed = {k: getattr(args, k) for k in RUN_OPTIONS}
    run_settings = {**fixed, "heads": Path(heads).name}
    try:
        commits = check_settings(out, run_settings, git_commit(ROOT), running=False)
    except SettingsMismatch as exc:
        sys.exit(str(exc))
    if not args.report_only:
        log = Path(tempfile.mkdtemp(prefix="policies-")) / "server.log"
        server = start_server(heads, options, args.serve_args, args.kv_cache_gib, log, args.kv_cache_blocks)
        try:
            server.wait_ready(timeout=900)
            note_kv_budget(out, Path(log).read_text(errors="replace"))  # refuses another budget than the run's
            commits = check_settings(out, run_settings, git_commit(ROOT))  # this sitting's code joins the run
            store = UnitStore(out)
            if args.rerun:
                again = [p for p in args.rerun.split(",") if p]
                dropped = store.drop(again)
                note_rerun(out, again, git_commit(ROOT), dropped)
                print(f"dropped {dropped} saved units of {', '.join(again)}: they run again")
            settings = ReplaySettings(
                url=server.base_url, max_tokens=args.max_tokens, concurrency=args.concurrency, reset_prefix_cache=True
            )
            stop = args.stop_after_min * 60 if args.stop_after_min is not None else None
            ran = asyncio.run(run_units(settings, groups, policies, store, stop))
        finally:
            server.stop()
        print(f"{ran} (group, policy) runs this time; server log {log}")
    report(out, groups, policies, commits, args)


if __name__ == "__main__":
    main()
