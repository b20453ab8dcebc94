"""vLLM's ways to scale, with the plugin: capture correctness in each mode,
and a replica failover behind vLLM's router, measured in one run.

    .venv/bin/python -m benchmarks.scale                       # every mode, then the failover
    .venv/bin/python -m benchmarks.scale --modes single,api2 --no-failover

Capture correctness. A tiny random Llama (two attention heads, so tensor
parallel 2 divides them; built here in seconds, ``tests/support/tiny_models.py``)
is served in each mode: ``single``; ``api2`` (``--api-server-count 2``);
``dp2`` (``--data-parallel-size 2``: two engine cores, and by vLLM's default two
API processes); ``tp2`` (``--tensor-parallel-size 2``). On two cores the
parallel modes bind one core per rank (``VLLM_CPU_OMP_THREADS_BIND=0|1``).
Sessions send one prompt each (a user turn of a tau-bench trajectory),
four at a time, each on a new connection so vLLM spreads them over its API
processes. Per mode: requests answered, responses that carried their
capture, capture records the API processes received (``/metrics``; one per
request means exactly one capture each), API processes that served, and the
cosine between each session's captured state (kept in the store) and the
single-process one.

Failover. Two replicas of the default model with PaMER (heads that always
vote to compress, the paper's schedule, so memories come early) behind vLLM's
router (consistent hashing on ``X-Session-ID``) share one PostgreSQL store (a
throw-away cluster, ``tests/support/postgres.py``). A session replays a tau-bench
trajectory; once it has a memory, its replica is killed (SIGKILL) and the rest
goes through the router to the other one. The scenarios: ``tests/support/scale.py``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import msgspec

from tests.support.postgres import Cluster
from tests.support.scale import MODES, compress_heads, min_cosine, run_failover, run_mode, user_turns
from tests.support.tiny_models import build_tiny_model
from vllm_pamer.default_model import ensure_default_model
from vllm_pamer.trajectories import load_trajectories


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)} (single is always run)")
    parser.add_argument("--sessions", type=int, default=16, help="sessions (one prompt each) per mode")
    parser.add_argument("--no-failover", action="store_true")
    parser.add_argument("--failover-steps", type=int, default=14, help="requests of the replayed trajectory")
    args = parser.parse_args(argv)
    modes = ["single", *[m for m in args.modes.split(",") if m != "single"]]
    with tempfile.TemporaryDirectory(prefix="pamer-scale-") as folder:
        workdir = Path(folder)
        model_dir = build_tiny_model("llama", workdir / "tiny-llama", ensure_default_model(quiet=True))
        prompts = user_turns(args.sessions)
        results = []
        for mode in modes:
            print(f"serving the tiny Llama: {mode} ...", flush=True)
            results.append(run_mode(mode, model_dir, prompts, workdir))
        print("\n| mode | requests | answered | with their capture | capture records | API processes | min cosine |")
        print("|---|---|---|---|---|---|---|")
        for result in results:
            cosine = min_cosine(result, results[0])
            print(
                f"| {result.mode} | {result.requests} | {result.answered} | {result.captured} | {result.records} "
                f"| {result.api_processes} | {'-' if cosine is None else f'{cosine:.6f}'} |"
            )
        if args.no_failover:
            return
        print("\nfailover: two replicas of the default model behind vLLM's router, one PostgreSQL store ...")
        with Cluster() as cluster:
            trajectory = load_trajectories(kind="tau")[0]
            failover = run_failover(
                compress_heads(workdir / "heads.safetensors"),
                cluster.new_database(),
                trajectory,
                args.failover_steps,
                workdir,
            )
        print(msgspec.json.format(msgspec.json.encode(failover)).decode())


if __name__ == "__main__":
    main()
