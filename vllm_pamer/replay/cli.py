"""``vllm-pamer replay``: replay recorded trajectories against a running server,
one policy after another, and report what each policy cost and kept.

    vllm-pamer replay --url http://127.0.0.1:8000 --data PATH [--data PATH] \\
        --policies none,recent_k --limit-trajectories N --max-steps N \\
        --concurrency N --max-tokens 64 --out DIR
    vllm-pamer replay --frontier [--frontier-k 2,10,20] --data PATH   (offline, no server)

The server must let requests choose the replayed policies (``vllm-pamer serve
--pamer-allowed-policies '*'``, or the ones named); a refused one is recorded
as an error with the server's message.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def _load(paths: Sequence[str] | None, limit: int | None) -> list[dict[str, Any]]:
    from vllm_pamer.trajectories import load_trajectories

    sets = (
        [load_trajectories(p) for p in paths]
        if paths
        else [load_trajectories(None, "tau"), load_trajectories(None, "swe")]
    )
    return [t for trajectories in sets for t in (trajectories[:limit] if limit is not None else trajectories)]


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def main(argv: Sequence[str] | None = None) -> int:
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
        "VLLM_SERVER_DEV_MODE=1), so prefill figures compare across policies",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    from tqdm import tqdm

    trajectories = _load(args.data, args.limit_trajectories)
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

    from vllm_pamer.replay.client import ReplaySettings, plan_replay, run_replay
    from vllm_pamer.replay.report import markdown_table, write_report

    settings = ReplaySettings(
        url=args.url,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        model=args.model,
        progress=not args.no_progress,
        reset_prefix_cache=args.reset_prefix_cache,
    )
    plans = plan_replay(tqdm(trajectories, desc="evidence", unit="traj", disable=args.no_progress), args.max_steps)
    print(
        f"replaying {len(plans)} trajectories ({sum(len(p.steps) for p in plans)} requests each run) "
        f"with {', '.join(policies)} against {args.url}"
    )
    import httpx

    try:
        records, runs = run_replay(settings, policies, plans)
    except httpx.HTTPError as exc:  # no server there (request errors are recorded, not raised)
        sys.exit(f"vllm-pamer replay: cannot reach {args.url}: {exc}")
    rows = write_report(args.out, records, runs, trajectories=trajectories)
    print(markdown_table(rows))
    print(f"records, summary and plot in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
