"""``vllm-pamer replay``: replay recorded trajectories against a server, one
policy after another, and report what each policy cost and kept.

    vllm-pamer replay --url http://127.0.0.1:8000 --data PATH [--data PATH] \\
        --policies none,recent_k --limit-trajectories N --max-steps N \\
        --concurrency N --max-tokens 64 --out DIR
    vllm-pamer replay --serve --reset-prefix-cache --group-size 4 \\
        --policies none,recent_k,pamer,pamer_tight --out DIR [--stop-after-min MIN]
    vllm-pamer replay --frontier [--frontier-k 2,10,20] --data PATH   (offline, no server)

The server must let requests choose the replayed policies (``vllm-pamer serve
--pamer-allowed-policies '*'``, or the ones named); a refused one is recorded
as an error with the server's message. ``--serve`` starts such a server of the
embedded model for the replay alone, serving the named variants of
``vllm_pamer/replay/variants.py`` (``pamer_tight``, ``pamer_paper``, ...).

``--group-size N`` makes the run resumable (``vllm_pamer/replay/runs.py``):
the trajectories in groups of N per kind, every policy on a group before the
next group, each finished (group, policy) saved in ``OUT/units.jsonl.gz``.
The same command again resumes after the last saved unit (``OUT/settings.json``
refuses other settings, except policies appended to ``--policies``, which run on
every group); the report covers the groups every policy finished.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_pamer.server_process import ServerProcess
    from vllm_pamer.trajectories import Split

RUN_OPTIONS = (
    "data",
    "split",
    "context_budget",
    "likelihood",
    "tool_seconds",
    "stream",
    "limit_trajectories",
    "max_steps",
    "group_size",
    "concurrency",
    "max_tokens",
    "policies",
    "reset_prefix_cache",
    "serve",
)
"""What a resumed run (``--group-size``) must repeat; with ``--serve`` also ``SERVE_OPTIONS`` and the heads."""
SERVE_OPTIONS = ("summary_tokens", "serve_args", "kv_cache_gib")
RESUMABLE_ONLY = ("stop_after_min", "rerun", "report_only", "against")
SERVE_ONLY = ("heads", "kv_cache_gib", "kv_cache_blocks")


def _load(paths: Sequence[str] | None, limit: int | None, split: Split | None = None) -> list[dict[str, Any]]:
    from vllm_pamer.trajectories import in_split, load_trajectories

    sets = (
        [load_trajectories(p) for p in paths]
        if paths
        else [load_trajectories(None, "tau"), load_trajectories(None, "swe")]
    )
    sets = [in_split(trajectories, split) for trajectories in sets]
    return [t for trajectories in sets for t in (trajectories[:limit] if limit is not None else trajectories)]


def add_stream_option(parser: argparse.ArgumentParser) -> None:
    """``--stream``, for the replay and the policies benchmark alike."""
    parser.add_argument(
        "--stream",
        action="store_true",
        default=None,  # absent from a run's settings.json when not given: runs before it resume
        help="stream each answer and report its time to first token (chat completions; not with --likelihood, nor "
        "with SAM, whose memory tool is offered on plain requests only)",
    )


def stream_refusal(stream: bool | None, likelihood: bool, policies: Sequence[str]) -> str | None:
    """Why ``--stream`` cannot run with these options (None: it can)."""
    if stream and likelihood:
        return "--stream and --likelihood: the likelihood pass reads a plain answer"
    if stream and any(p.startswith("sam") for p in policies):
        return "--stream: SAM offers its memory tool on plain requests only, so a streamed SAM is another policy"
    return None


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-pamer replay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    parser.add_argument(
        "--data",
        action="append",
        default=None,
        metavar="PATH",
        help="trajectories (.jsonl or .jsonl.gz); repeatable (default: both shipped samples)",
    )
    parser.add_argument(
        "--policies", default="none,recent_k", help="comma-separated, run in this order (default %(default)s)"
    )
    parser.add_argument(
        "--split",
        choices=("tuning", "evaluation"),
        default=None,
        help="only the trajectories of this split (vllm_pamer/data/splits.json, by task; default: all)",
    )
    parser.add_argument(
        "--limit-trajectories", type=int, default=None, metavar="N", help="first N trajectories of each file"
    )
    parser.add_argument("--max-steps", type=int, default=None, metavar="N", help="first N requests of each trajectory")
    parser.add_argument("--concurrency", type=int, default=1, metavar="N", help="sessions in flight (default 1)")
    parser.add_argument(
        "--max-tokens", type=int, default=64, metavar="N", help="tokens generated per request (default 64)"
    )
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request timeout (default 600 s)")
    parser.add_argument("--out", default=None, metavar="DIR", help="report directory (required unless --frontier)")
    parser.add_argument("--frontier", action="store_true", help="print recent_k's evidence frontier offline and exit")
    parser.add_argument("--frontier-k", default="2,10,20", help="k values for --frontier (default %(default)s)")
    parser.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="empty the server's prefix cache before each policy (server started with "
        "VLLM_SERVER_DEV_MODE=1, as --serve starts it), so prefill figures compare across policies",
    )
    parser.add_argument(
        "--context-budget",
        default=None,
        metavar="KIND=TOKENS,...",
        help="the context budget every request of a kind sets (X-Pamer-Context-Budget), e.g. tau=3000,swe=4096",
    )
    parser.add_argument(
        "--likelihood",
        action="store_true",
        help="after each policy's run, score each answered request's recorded next action given what the policy "
        "sent (teacher forced through the server's prompt log-probabilities; a full prefill a request)",
    )
    parser.add_argument(
        "--tool-seconds",
        type=float,
        default=None,
        metavar="S",
        help="seconds a session waits between an answer and its next request (its tools running; default 0)",
    )
    add_stream_option(parser)
    parser.add_argument(
        "--api",
        choices=("chat", "responses"),
        default="chat",
        help="the API the steps are sent through: chat completions, or the Responses API (the whole history as "
        "input items each step)",
    )
    parser.add_argument("--no-progress", action="store_true")

    own = parser.add_argument_group("its own server (--serve)")
    own.add_argument(
        "--serve",
        action="store_true",
        help="start a vllm-pamer serve of the embedded model for this replay (instead of --url), stopped at the end",
    )
    own.add_argument("--heads", default=None, metavar="PATH", help="heads file (default: the shipped trained heads)")
    own.add_argument(
        "--serve-args",
        default="--enforce-eager --enable-prompt-tokens-details",
        help="vLLM flags of that server (default %(default)r)",
    )
    own.add_argument(
        "--summary-tokens", type=int, default=96, metavar="N", help="summary / cue / recall length (default 96)"
    )
    own.add_argument("--kv-cache-gib", type=float, default=None, help="its KV cache in GiB (--kv-cache-memory-bytes)")
    own.add_argument(
        "--kv-cache-blocks", type=int, default=None, help="its KV cache in blocks (--num-gpu-blocks-override)"
    )

    runs = parser.add_argument_group("a resumable run (--group-size)")
    runs.add_argument(
        "--group-size",
        type=int,
        default=None,
        metavar="N",
        help="trajectories per group: every policy runs on a group before the next, each (group, policy) is saved, "
        "the same command resumes",
    )
    runs.add_argument(
        "--stop-after-min", type=float, default=None, metavar="MIN", help="start no new (group, policy) after MIN"
    )
    runs.add_argument(
        "--rerun", default="", metavar="POLICIES", help="drop these policies' saved units and run them again"
    )
    runs.add_argument("--report-only", action="store_true", help="write the report from the saved units and exit")
    runs.add_argument(
        "--against",
        default=None,
        metavar="DIR",
        help="another run's --out: the report adds steps / min here and there on the groups both finished",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.group_size is None and any(getattr(args, name) for name in RESUMABLE_ONLY):
        parser.error("--stop-after-min, --rerun, --report-only and --against need --group-size")
    if not args.serve and any(getattr(args, name) is not None for name in SERVE_ONLY):
        parser.error("--heads, --kv-cache-gib and --kv-cache-blocks need --serve")
    if args.likelihood and args.api != "chat":
        parser.error("--likelihood scores through chat completions: replay with --api chat")
    if args.stream and args.api != "chat":
        parser.error("--stream reads chat completions' chunks: replay with --api chat")
    if refused := stream_refusal(args.stream, args.likelihood, _csv(args.policies)):
        parser.error(refused)

    from tqdm import tqdm

    trajectories = _load(args.data, args.limit_trajectories, args.split)
    if args.frontier:
        from vllm_pamer.replay.evidence import format_frontier, recency_frontier

        ks = [int(k) for k in _csv(args.frontier_k)]
        bar = tqdm(trajectories, desc="frontier", unit="traj", disable=args.no_progress)
        print(format_frontier(recency_frontier(bar, ks, args.max_steps)))
        return 0
    if not args.out:
        parser.error("--out is required (unless --frontier)")
    policies = _csv(args.policies)
    if not policies:
        parser.error("--policies is empty")

    from vllm_pamer.replay.client import ReplaySettings, parse_budgets, plan_replay

    try:
        budgets = parse_budgets(args.context_budget) if args.context_budget else None
    except ValueError as exc:
        parser.error(str(exc))
    settings = ReplaySettings(
        url=args.url,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        model=args.model,
        progress=not args.no_progress,
        reset_prefix_cache=args.reset_prefix_cache,
        context_budget=budgets,
        likelihood=args.likelihood,
        tool_s=args.tool_seconds or 0.0,
        stream=bool(args.stream),
        api=args.api,
    )
    plans = plan_replay(tqdm(trajectories, desc="evidence", unit="traj", disable=args.no_progress), args.max_steps)
    if args.group_size is not None:
        return _resumable(args, argv, settings, plans, policies, trajectories)
    return _once(args, settings, plans, policies, trajectories)


def _own_server(args: argparse.Namespace) -> tuple[Callable[[], ServerProcess], str] | None:
    """``--serve``: a function that starts its server (not waited for), and
    the heads file's name; None without ``--serve``."""
    if not args.serve:
        return None
    from vllm_pamer.default_model import ensure_default_model, shipped_heads
    from vllm_pamer.replay.own_server import start_server
    from vllm_pamer.replay.variants import policy_options

    ensure_default_model(quiet=True)
    heads = args.heads or shipped_heads()
    if heads is None:
        sys.exit("vllm-pamer replay: no heads ship with this install: pass --heads")
    options = policy_options(args.summary_tokens)

    def start():
        log = Path(tempfile.mkdtemp(prefix="replay-")) / "server.log"
        return start_server(heads, options, args.serve_args, args.kv_cache_gib, log, args.kv_cache_blocks)

    return start, Path(heads).name


def _once(args, settings, plans, policies, trajectories) -> int:
    """Every policy over every trajectory, one after another."""
    import dataclasses

    import httpx

    from vllm_pamer.replay.client import run_replay
    from vllm_pamer.replay.report import markdown_table, write_report

    own = _own_server(args)
    server = own[0]() if own is not None else None
    url = "its own server" if server is not None else args.url
    print(
        f"replaying {len(plans)} trajectories ({sum(len(p.steps) for p in plans)} requests each run) "
        f"with {', '.join(policies)} against {url}"
    )
    try:
        if server is not None:
            server.wait_ready(timeout=900)
            settings = dataclasses.replace(settings, url=server.base_url)
        records, runs = run_replay(settings, policies, plans)
    except httpx.HTTPError as exc:  # no server there (request errors are recorded, not raised)
        sys.exit(f"vllm-pamer replay: cannot reach {settings.url}: {exc}")
    finally:
        if server is not None:
            server.stop()
    rows = write_report(args.out, records, runs, trajectories=trajectories)
    print(markdown_table(rows))
    print(f"records, summary and plot in {args.out}")
    return 0


def _resumable(args, argv, settings, plans, policies, trajectories) -> int:
    """The run in groups (``replay/runs.py``): this sitting's units, then the report."""
    import httpx

    from vllm_pamer import __version__
    from vllm_pamer.replay.run_report import write_finished_report
    from vllm_pamer.replay.runs import GroupedRun, make_groups, run_command, sit

    own = _own_server(args)
    fixed = {name: getattr(args, name) for name in RUN_OPTIONS}
    if own is not None:
        fixed |= {name: getattr(args, name) for name in SERVE_OPTIONS} | {"heads": own[1]}
    tau, swe = ([p for p in plans if p.kind == kind] for kind in ("tau", "swe"))
    groups = make_groups(tau, swe, args.group_size, args.group_size)
    run = GroupedRun(Path(args.out), groups, policies, fixed, f"vllm-pamer {__version__}")
    start = own[0] if own is not None else None
    try:
        commits = sit(run, settings, start, args.stop_after_min, _csv(args.rerun), args.report_only)
    except httpx.HTTPError as exc:  # as in _once: no server there
        sys.exit(f"vllm-pamer replay: cannot reach {settings.url}: {exc}")
    workload = (
        f"(at most {args.max_steps or 'all'} requests each), {args.concurrency} sessions at a time, "
        f"{args.max_tokens} tokens generated per request"
        + (f", summaries / cues / recalls <= {args.summary_tokens} tokens" if own is not None else "")
    )
    command = run_command("vllm-pamer replay", argv, Path.cwd())
    write_finished_report(run, commits, workload, command, trajectories, against=args.against)
    return 0


if __name__ == "__main__":
    sys.exit(main())
