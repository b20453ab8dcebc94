"""Every policy on recorded trajectories, side by side: one ``vllm-pamer
serve`` of the embedded model, the replay harness (``vllm_pamer.replay``) run
per group of trajectories and per policy, its report and plots written to
``--out`` (default benchmarks/results/policies/).

    .venv/bin/python benchmarks/policies.py --tau 3 --swe 1 --max-steps 10   # CPU-sized subsample, minutes
    .venv/bin/python benchmarks/policies.py --tau 0 --swe 8 --swe-max-steps 30 --group-size 8 \\
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
trajectories. Each finished (group, policy) unit is saved under
``OUT/units/``; running the same command again resumes after the last saved
unit (the settings must match; ``OUT/settings.json``). ``--stop-after-min``
starts no new unit after that many minutes, so a long run can be spread over
several sittings. The report covers the groups every policy finished.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.helpers import free_port  # noqa: E402
from vllm_pamer.default_model import ensure_default_model, shipped_heads  # noqa: E402
from vllm_pamer.demo import ServerProcess  # noqa: E402
from vllm_pamer.replay.client import ReplaySettings, TrajectoryPlan, connect, plan_replay, replay_policy  # noqa: E402
from vllm_pamer.replay.records import RunSummary, StepRecord  # noqa: E402
from vllm_pamer.replay.report import KIND_TITLES, fmt, markdown_table, summarize, write_report  # noqa: E402
from vllm_pamer.trajectories import load_trajectories  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "trajectories"


def shared_or_shipped(name: str, kind: str) -> list[dict]:
    """The ``../shared`` trajectories ``name`` where they exist, else the
    shipped sample of that ``kind``."""
    path = DATA / f"{name}.jsonl.gz"
    return load_trajectories(path if path.exists() else None, kind=kind)
POLICIES = ("none,sliding_window,recent_k,discard_tool,periodic_summary,rolling_summary,"
            "pamer,pamer_text_query,pamer_unstable,pamer_conversation,pamer_plus,sam")


RUN_OPTIONS = ("tau", "swe", "max_steps", "swe_max_steps", "order", "seed", "group_size", "swe_group_size",
               "concurrency", "max_tokens", "summary_tokens", "serve_args", "policies", "kv_cache_gib")
"""What a resumed run must repeat (settings.json)."""


class Unit(msgspec.Struct):
    """One policy's run over one group: what ``OUT/units/<group>--<policy>.json.gz`` holds."""

    run: RunSummary
    records: list[StepRecord]


def policy_options(summary_tokens: int) -> dict[str, dict]:
    n = summary_tokens
    return {
        "pamer": {"summary_max_tokens": n},
        "pamer_plus": {"summary_max_tokens": n, "recall_max_tokens": n},
        "periodic_summary": {"summary_max_tokens": n},
        "rolling_summary": {"summary_max_tokens": n},
        "sam": {"cue_max_tokens": n, "recall_max_tokens": n},
        # PaMER without stable recall: what the margin buys in prefix-cache reuse
        "pamer_unstable": {"policy": "pamer", "summary_max_tokens": n, "stable_recall": False},
        # PaMER whose summary request continues the conversation the engine last saw (prefix-cache hits)
        "pamer_conversation": {"policy": "pamer", "summary_max_tokens": n, "summary_layout": "conversation"},
        # PaMER with the paper's recall query (task + R embedded by a request) instead of the captured state
        "pamer_text_query": {"policy": "pamer", "summary_max_tokens": n, "query_source": "text"},
    }


def load_plans(args: argparse.Namespace) -> tuple[list[TrajectoryPlan], list[TrajectoryPlan]]:
    """The tau-bench and mini-swe plans chosen by the options (first N, maybe shuffled)."""
    chosen = []
    for name, count, steps in (("tau_airline", args.tau, args.max_steps),
                               ("mini_swe", args.swe, args.swe_max_steps or args.max_steps)):
        if count < 0:
            chosen.append([])
            continue
        loaded = load_trajectories(DATA / f"{name}.jsonl.gz")
        loaded = loaded if count == 0 else loaded[:count]
        if args.order == "random":
            loaded = random.Random(args.seed).sample(loaded, len(loaded))
        chosen.append(plan_replay(loaded, steps))
    return chosen[0], chosen[1]


def start_server(heads: str, options: dict, serve_args: str, kv_cache_gib: float | None, log: Path) -> ServerProcess:
    """The benchmark's ``vllm-pamer serve`` (not waited for): every policy
    selectable per request, a fresh memory store beside ``log``."""
    serve = ["--pamer-policy", "none", "--pamer-heads", str(heads), "--pamer-options-by-policy",
             json.dumps(options), *serve_args.split()]
    if kv_cache_gib is not None:
        serve += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    # dev mode serves POST /reset_prefix_cache: each run starts from an empty
    # prefix cache, so "prefill computed" compares across policies
    env = {"PAMER_STORE": str(log.parent / "memory.sqlite3"), "VLLM_SERVER_DEV_MODE": "1"}
    # vLLM's CPU engine keeps a core for its scheduler unless told not to:
    # on 2 cores, letting it use both ran this replay 1.3x faster (measured)
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return ServerProcess(serve, free_port(), log, env=env)


def make_groups(tau: list[TrajectoryPlan], swe: list[TrajectoryPlan], tau_size: int,
                swe_size: int) -> list[tuple[str, list[TrajectoryPlan]]]:
    """Named groups of plans, tau and swe interleaved (a swe group first, then
    one every so many tau groups), so any prefix of the run holds both kinds."""
    tau_groups = [(f"tau-{i // tau_size:03d}", tau[i:i + tau_size]) for i in range(0, len(tau), tau_size)]
    swe_groups = [(f"swe-{i // swe_size:03d}", swe[i:i + swe_size]) for i in range(0, len(swe), swe_size)]
    every = max(1, len(tau_groups) // max(1, len(swe_groups)))
    groups: list[tuple[str, list[TrajectoryPlan]]] = []
    for i, group in enumerate(tau_groups):
        if i % every == 0 and swe_groups:
            groups.append(swe_groups.pop(0))
        groups.append(group)
    return groups + swe_groups


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def check_settings(out: Path, settings: dict, running: bool = True) -> list[str]:
    """Write ``settings.json`` on a first run; on a resume, refuse other settings.
    Returns the commits that ran so far (this one appended when ``running``)."""
    path = out / "settings.json"
    commit = git_commit()
    if path.exists():
        saved = json.loads(path.read_text())
        commits = saved.pop("commits", [])
        kv_tokens = saved.pop("kv_cache_tokens", None)  # what the server reported, not an option
        # an option added since the run began reads as unset (None) in it
        changed = sorted(k for k in {*saved, *settings} if saved.get(k) != settings.get(k))
        if changed:
            sys.exit(f"{out} holds a run with other settings ({', '.join(changed)}): "
                     "pass the same options to resume it, or another --out")
    else:
        commits, kv_tokens = [], None
    if running and commit not in commits:
        commits.append(commit)
    out.mkdir(parents=True, exist_ok=True)
    extra = {"kv_cache_tokens": kv_tokens} if kv_tokens is not None else {}
    path.write_text(json.dumps({**settings, "commits": commits, **extra}, indent=2) + "\n")
    return commits


KV_TOKENS_RE = re.compile(r"KV cache size: ([\d,]+) tokens")


def note_kv_budget(out: Path, log_text: str) -> int | None:
    """The KV-cache budget the server reported (tokens), kept in settings.json
    (every sitting runs the same server options, so the same budget)."""
    match = KV_TOKENS_RE.search(log_text)
    if match is None:
        return None
    tokens = int(match.group(1).replace(",", ""))
    path = out / "settings.json"
    settings = json.loads(path.read_text())
    settings["kv_cache_tokens"] = tokens
    path.write_text(json.dumps(settings, indent=2) + "\n")
    return tokens


def unit_path(out: Path, group: str, policy: str) -> Path:
    return out / "units" / f"{group}--{policy}.json.gz"


def save_unit(path: Path, unit: Unit) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(gzip.compress(msgspec.json.encode(unit)))
    partial.replace(path)  # a unit is there whole or not at all


def load_unit(path: Path) -> Unit:
    return msgspec.json.decode(gzip.decompress(path.read_bytes()), type=Unit)


async def run_units(settings: ReplaySettings, groups, policies: list[str], out: Path, stop_after_s: float | None) -> int:
    """Each (group, policy) not saved yet, in order; returns how many ran."""
    started, ran = time.monotonic(), 0
    async with connect(settings) as (client, model):
        for group, plans in groups:
            for policy in policies:
                path = unit_path(out, group, policy)
                if path.exists():
                    continue
                if stop_after_s is not None and time.monotonic() - started > stop_after_s:
                    return ran
                print(f"{group} ({len(plans)} trajectories, {sum(len(p.steps) for p in plans)} requests): {policy}")
                records, run = await replay_policy(client, settings, model, policy, plans)
                run.group = group
                save_unit(path, Unit(run, records))
                ran += 1
    return ran


def run_command(argv: list[str]) -> str:
    """The command that (re)produces the run: without the sitting's own flags
    (``--stop-after-min``, ``--report-only``), ``--out`` relative to the repository."""
    words, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word == "--stop-after-min":
            skip = True
            continue
        if word == "--report-only" or word.startswith("--stop-after-min="):
            continue
        path = Path(word)
        if path.is_absolute() and path.is_relative_to(ROOT):
            word = str(path.relative_to(ROOT))
        words.append(word)
    return " ".join([".venv/bin/python", "benchmarks/policies.py", *words])


def kv_budget(out: Path) -> str:
    path = out / "settings.json"
    tokens = json.loads(path.read_text()).get("kv_cache_tokens") if path.exists() else None
    return f"{tokens:,}" if tokens else "unreported"


def load_units(out: Path, groups: list[str], policies: list[str]) -> list[Unit]:
    """The saved units of these groups and policies, policy by policy in the
    order given (so the report's merged rows come out in that order)."""
    return [load_unit(unit_path(out, g, p)) for p in policies for g in groups]


def rows_by_policy(out: Path, groups: list[str], policies: list[str]) -> dict:
    """The report rows of the saved units of these groups and policies, by policy."""
    units = load_units(out, groups, policies)
    return {row.policy: row for row in summarize([r for u in units for r in u.records], [u.run for u in units])}


def against_section(out: Path, other: Path, groups, policies: list[str]) -> str:
    """This run's serving figures next to another run's (say the same groups
    with more KV memory), per kind, on the groups both finished for every
    policy: steps / min and their ratio, peak KV use, prefill computed. The two
    runs ran one after the other, not interleaved: quote them as such."""
    parts = [f"\n## Against `{other}`\n\nThe same groups and policies in both runs; ratio = this run / that run.\n"]
    for kind in ("swe", "tau"):
        shared = [g for g, _ in groups if g.startswith(kind)
                  and all(unit_path(d, g, p).exists() for d in (out, other) for p in policies)]
        if not shared:
            continue
        here, there = rows_by_policy(out, shared, policies), rows_by_policy(other, shared, policies)
        trajectories = here[policies[0]].trajectories
        parts += [f"\n### {KIND_TITLES.get(kind, kind)} ({len(shared)} groups, {trajectories} trajectories)\n",
                  "| policy | mean peak context | peak KV | peak KV there | steps / min | steps / min there | ratio "
                  "| prefill computed | prefill computed there | preemptions |", "|" + "---|" * 10]
        for policy in policies:
            a, b = here[policy], there[policy]
            ratio = a.steps_per_min / b.steps_per_min if a.steps_per_min and b.steps_per_min else None
            cells = [policy, fmt(a.mean_peak_context), fmt(a.peak_kv_usage, "pct"), fmt(b.peak_kv_usage, "pct"),
                     fmt(a.steps_per_min, "rate"), fmt(b.steps_per_min, "rate"), fmt(ratio, "rate"),
                     fmt(a.prefill_computed), fmt(b.prefill_computed), fmt(a.preemptions)]
            parts.append("| " + " | ".join(cells) + " |")
    return "\n".join(parts) + "\n" if len(parts) > 1 else ""


def report(out: Path, groups, policies: list[str], commits: list[str], args: argparse.Namespace) -> None:
    """The report over the groups every policy finished."""
    complete = [(g, plans) for g, plans in groups if all(unit_path(out, g, p).exists() for p in policies)]
    if not complete:
        print("no group finished by every policy yet: no report")
        return
    units = load_units(out, [g for g, _ in complete], policies)
    records = [r for u in units for r in u.records]
    runs = [u.run for u in units]
    kinds = {k: sum(len(plans) for g, plans in complete if g.startswith(k)) for k in ("tau", "swe")}
    preface = (
        f"{len(complete)} of {len(groups)} groups finished by all {len(policies)} policies: "
        f"{kinds['tau']} tau-bench and {kinds['swe']} mini-swe trajectories (at most {args.max_steps or 'all'} / "
        f"{args.swe_max_steps or args.max_steps or 'all'} requests each), {args.concurrency} sessions at a time, "
        f"{args.max_tokens} tokens generated per request, summaries / cues / recalls <= {args.summary_tokens} tokens, "
        f"KV cache of {kv_budget(out)} tokens. Code: {', '.join(commits)}. Command: `{run_command(sys.argv[1:])}`\n"
    )
    # the replayed trajectories, for the over-recency column (absent data: the column stays empty)
    paths = [DATA / f"{name}.jsonl.gz" for name in ("tau_airline", "mini_swe")]
    trajectories = [t for path in paths if path.exists() for t in load_trajectories(path)]
    rows = write_report(out, records, runs, records_name=None, title="Policies side by side", preface=preface,
                        trajectories=trajectories)
    print(markdown_table(rows))
    print(preface)
    if args.against:
        section = against_section(out, Path(args.against), groups, policies)
        with (out / "report.md").open("a") as report_md:
            report_md.write(section or f"\nNo group finished by every policy in both this run and {args.against}.\n")
        print(section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--tau", type=int, default=4, help="first N tau-bench trajectories (0 = all, -1 = none)")
    parser.add_argument("--swe", type=int, default=1, help="first N mini-swe trajectories (0 = all, -1 = none)")
    parser.add_argument("--max-steps", type=int, default=None, help="first N requests of each trajectory")
    parser.add_argument("--swe-max-steps", type=int, default=None, help="for mini-swe (default: --max-steps)")
    parser.add_argument("--order", choices=("first", "random"), default="first",
                        help="group the chosen trajectories in file order or shuffled (--seed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=4, help="trajectories per group (default %(default)s)")
    parser.add_argument("--swe-group-size", type=int, default=None, help="for mini-swe (default: --group-size)")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--summary-tokens", type=int, default=96, help="summary / cue / recall length")
    parser.add_argument("--heads", default=None)
    parser.add_argument("--serve-args", default="--enforce-eager --enable-prompt-tokens-details")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="the KV-cache budget in GiB (vLLM's --kv-cache-memory-bytes, CPU or GPU). Small "
                             "budgets and more --concurrency show what shorter contexts buy when KV memory is "
                             "what limits the server")
    parser.add_argument("--stop-after-min", type=float, default=None,
                        help="start no new (group, policy) run after this many minutes; run again to resume")
    parser.add_argument("--report-only", action="store_true", help="write the report from the saved units and exit")
    parser.add_argument("--against", default=None, metavar="DIR",
                        help="another run's --out (e.g. the same groups with more KV memory): the report adds "
                             "steps / min here and there, per kind, on the groups both finished")
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
    commits = check_settings(out, {**fixed, "heads": Path(heads).name}, running=not args.report_only)
    if not args.report_only:
        log = Path(tempfile.mkdtemp(prefix="policies-")) / "server.log"
        server = start_server(heads, options, args.serve_args, args.kv_cache_gib, log)
        try:
            server.wait_ready(timeout=900)
            note_kv_budget(out, Path(log).read_text(errors="replace"))
            settings = ReplaySettings(url=server.base_url, max_tokens=args.max_tokens, concurrency=args.concurrency,
                                      reset_prefix_cache=True)
            stop = args.stop_after_min * 60 if args.stop_after_min is not None else None
            ran = asyncio.run(run_units(settings, groups, policies, out, stop))
        finally:
            server.stop()
        print(f"{ran} (group, policy) runs this time; server log {log}")
    report(out, groups, policies, commits, args)


if __name__ == "__main__":
    main()
