"""Every policy on recorded trajectories, side by side in one run: one
``vllm-pamer serve`` of the embedded model, the replay harness
(``vllm_pamer.replay``) run once per policy, its report and plot written to
``--out`` (default benchmarks/results/policies/).

    .venv/bin/python benchmarks/policies.py                       # CPU-sized subsample
    .venv/bin/python benchmarks/policies.py --tau 0 --swe 0       # every shared trajectory (GPU)

Data: ../shared/data/trajectories/{tau_airline,mini_swe}.jsonl.gz, the first
``--tau`` / ``--swe`` trajectories of each (0 = all), their first ``--max-steps``
requests. Heads: the shipped trained heads of the embedded model (or
``--heads``). Internal answers are shortened with ``--summary-tokens`` so a
CPU run ends in minutes; say so when quoting the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.helpers import free_port  # noqa: E402
from vllm_pamer.default_model import ensure_default_model, shipped_heads  # noqa: E402
from vllm_pamer.demo import ServerProcess  # noqa: E402
from vllm_pamer.replay.client import ReplaySettings, plan_replay, run_replay  # noqa: E402
from vllm_pamer.replay.report import markdown_table, write_report  # noqa: E402
from vllm_pamer.trajectories import load_trajectories  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "trajectories"
POLICIES = ("none,recent_k,recent_10,discard_tool,periodic_summary,rolling_summary,"
            "pamer,pamer_unstable,pamer_conversation,pamer_plus,sam")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--tau", type=int, default=4, help="first N tau-bench trajectories (0 = all)")
    parser.add_argument("--swe", type=int, default=1, help="first N mini-swe trajectories (0 = all)")
    parser.add_argument("--max-steps", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--summary-tokens", type=int, default=96, help="summary / cue / recall length")
    parser.add_argument("--heads", default=None)
    parser.add_argument("--serve-args", default="--enforce-eager")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "policies"))
    args = parser.parse_args()

    ensure_default_model(quiet=True)
    heads = args.heads or shipped_heads()
    if heads is None:
        sys.exit("no heads: ship trained heads (vllm-pamer train) or pass --heads")
    n = args.summary_tokens
    options = {
        "pamer": {"summary_max_tokens": n},
        "pamer_plus": {"summary_max_tokens": n, "recall_max_tokens": n},
        "periodic_summary": {"summary_max_tokens": n},
        "rolling_summary": {"summary_max_tokens": n},
        "sam": {"cue_max_tokens": n, "recall_max_tokens": n},
        "recent_10": {"policy": "recent_k", "k": 10},
        # PaMER without stable recall: what the margin buys in prefix-cache reuse
        "pamer_unstable": {"policy": "pamer", "summary_max_tokens": n, "stable_recall": False},
        # PaMER whose summary request continues the conversation the engine last saw (prefix-cache hits)
        "pamer_conversation": {"policy": "pamer", "summary_max_tokens": n, "summary_layout": "conversation"},
    }
    trajectories = []
    for name, count in (("tau_airline", args.tau), ("mini_swe", args.swe)):
        loaded = load_trajectories(DATA / f"{name}.jsonl.gz")
        trajectories += loaded if count == 0 else loaded[:count]
    plans = plan_replay(trajectories, args.max_steps)
    log = Path(tempfile.mkdtemp(prefix="policies-")) / "server.log"
    serve = ["--pamer-policy", "none", "--pamer-heads", str(heads), "--pamer-options-by-policy", json.dumps(options),
             *args.serve_args.split()]
    # dev mode serves POST /reset_prefix_cache: each policy starts from an empty
    # prefix cache, so "prefill computed" compares across policies
    env = {"PAMER_STORE": str(log.parent / "memory.sqlite3"), "VLLM_SERVER_DEV_MODE": "1"}
    server = ServerProcess(serve, free_port(), log, env=env)
    try:
        server.wait_ready(timeout=900)
        settings = ReplaySettings(url=server.base_url, max_tokens=args.max_tokens, concurrency=args.concurrency,
                                  reset_prefix_cache=True)
        records, runs = run_replay(settings, [p for p in args.policies.split(",") if p], plans)
    finally:
        server.stop()
    rows = write_report(args.out, records, runs)
    print(markdown_table(rows))
    print(f"\n{len(plans)} trajectories ({args.tau or 'all'} tau, {args.swe or 'all'} mini-swe), "
          f"first {args.max_steps} requests each; summaries <= {n} tokens; report in {args.out}; server log {log}")


if __name__ == "__main__":
    main()
