"""Every policy on recorded trajectories, side by side: one ``vllm-pamer
serve`` of the embedded model, the replay harness (``vllm_pamer.replay``) run
per group of trajectories and per policy, its report and plots written to
``--out`` (default benchmarks/results/policies/).

    .venv/bin/python -m benchmarks.policies --tau 3 --swe 1 --max-steps 10   # CPU-sized subsample, minutes
    .venv/bin/python -m benchmarks.policies --tau 0 --swe 8 --swe-max-steps 30 --group-size 8 \\
        --swe-group-size 4 --order random --concurrency 8 --stop-after-min 100 \\
        --out benchmarks/results/policies-full                                   # resumable, hours

Data: ../shared/data/trajectories/{tau_airline,mini_swe}.jsonl.gz, the first
``--tau`` / ``--swe`` trajectories of each (0 = all; of ``--split`` when given),
at most ``--max-steps`` / ``--swe-max-steps`` requests each. Heads: the shipped trained heads of the
embedded model (or ``--heads``). Internal answers are shortened with
``--summary-tokens`` so a CPU run ends in hours, not days; say so when quoting.

Trajectories are split into groups of ``--group-size`` and every policy runs
on a group before the next group starts (prefix cache emptied before each
run), so a run stopped at any point still compares all policies on the same
trajectories. Each finished (group, policy) unit is saved in
``OUT/units.jsonl.gz``; running the same command again resumes after the
last saved unit (the settings must match, ``OUT/settings.json``, except that
policies may be appended to ``--policies``: they run on every group).
``--stop-after-min`` starts no new unit after that many minutes, so a long run
can be spread over several sittings. The report covers the groups every policy
finished. The run is ``vllm-pamer replay --group-size`` (``vllm_pamer/replay/runs.py``)
over this repository's data, with its settings and commits recorded.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from benchmarks._repo import DATA, ROOT, git_commit
from vllm_pamer.default_model import ensure_default_model, shipped_heads
from vllm_pamer.replay.cli import add_stream_option, stream_refusal
from vllm_pamer.replay.client import ReplaySettings, TrajectoryPlan, parse_budgets, plan_replay
from vllm_pamer.replay.own_server import start_server
from vllm_pamer.replay.run_report import write_finished_report
from vllm_pamer.replay.runs import GroupedRun, make_groups, run_command, sit
from vllm_pamer.replay.variants import policy_options
from vllm_pamer.trajectories import in_split, load_trajectories

POLICIES = "none,recent_k,pamer,pamer_tight,pamer_paper,sam"
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
    "split",
    "context_budget",
    "likelihood",
    "tool_seconds",
    "stream",
)
"""What a resumed run must repeat (settings.json)."""


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
        loaded = in_split(load_trajectories(DATA / f"{name}.jsonl.gz"), args.split)
        loaded = loaded if count == 0 else loaded[:count]
        if args.order == "random":
            loaded = random.Random(args.seed).sample(loaded, len(loaded))
        chosen.append(plan_replay(loaded, steps))
    return chosen[0], chosen[1]


def report(run: GroupedRun, commits: list[str], args: argparse.Namespace) -> None:
    """The report over the groups every policy finished."""
    workload = (
        f"(at most {args.max_steps or 'all'} / {args.swe_max_steps or args.max_steps or 'all'} requests each), "
        f"{args.concurrency} sessions at a time, {args.max_tokens} tokens generated per request, "
        f"summaries / cues / recalls <= {args.summary_tokens} tokens"
    )
    command = run_command(".venv/bin/python -m benchmarks.policies", sys.argv[1:], ROOT)
    # the replayed trajectories, for the over-recency column (absent data: the column stays empty)
    paths = [DATA / f"{name}.jsonl.gz" for name in ("tau_airline", "mini_swe")]
    trajectories = [t for path in paths if path.exists() for t in load_trajectories(path)]
    write_finished_report(run, commits, workload, command, trajectories, against=args.against, paired=args.paired)


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
    parser.add_argument(
        "--split",
        choices=("tuning", "evaluation"),
        default=None,
        help="only the trajectories of this split (vllm_pamer/data/splits.json; default: all): "
        "settings are chosen on tuning, figures reported on evaluation",
    )
    parser.add_argument(
        "--context-budget",
        default=None,
        metavar="KIND=TOKENS,...",
        help="the context budget every request of a kind sets (X-Pamer-Context-Budget), e.g. tau=3000,swe=4096: "
        "every policy with a budget at the same one (default: each policy's own)",
    )
    parser.add_argument(
        "--likelihood",
        action="store_true",
        help="after each policy's run, score each answered request's recorded next action given what was sent "
        "(teacher forced; a full prefill a request)",
    )
    parser.add_argument(
        "--tool-seconds",
        type=float,
        default=None,
        metavar="S",
        help="seconds a session waits between an answer and its next request (its tools running; default 0)",
    )
    add_stream_option(parser)
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
    parser.add_argument(
        "--paired",
        default=None,
        metavar="POLICY",
        help="the report sets this policy against each other one, request by request, with bootstrap "
        "intervals (e.g. pamer against the vote's ablations)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "policies"))
    args = parser.parse_args()
    if refused := stream_refusal(args.stream, args.likelihood, args.policies.split(",")):
        parser.error(refused)
    if args.paired is not None and args.paired not in args.policies.split(","):
        parser.error(f"--paired {args.paired}: not one of --policies {args.policies}")

    ensure_default_model(quiet=True)
    heads = args.heads or shipped_heads()
    if heads is None:
        sys.exit("no heads: ship trained heads (vllm-pamer train) or pass --heads")
    policies = [p for p in args.policies.split(",") if p]
    options = policy_options(args.summary_tokens)
    groups = make_groups(*load_plans(args), args.group_size, args.swe_group_size or args.group_size)
    fixed = {k: getattr(args, k) for k in RUN_OPTIONS}
    run = GroupedRun(Path(args.out), groups, policies, {**fixed, "heads": Path(heads).name}, git_commit(ROOT))

    def own_server():
        log = Path(tempfile.mkdtemp(prefix="policies-")) / "server.log"
        return start_server(heads, options, args.serve_args, args.kv_cache_gib, log, args.kv_cache_blocks)

    try:
        budgets = parse_budgets(args.context_budget) if args.context_budget else None
    except ValueError as exc:
        sys.exit(str(exc))
    replay = ReplaySettings(
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        reset_prefix_cache=True,
        context_budget=budgets,
        likelihood=args.likelihood,
        tool_s=args.tool_seconds or 0.0,
        stream=bool(args.stream),
    )
    rerun = [p for p in args.rerun.split(",") if p]
    commits = sit(run, replay, own_server, args.stop_after_min, rerun, args.report_only)
    report(run, commits, args)


if __name__ == "__main__":
    main()
