"""The long part of the adversarial suite, against a real ``vllm-pamer serve``
of the default model (the fast part: ``tests/e2e/test_fuzz_serve.py``).

    .venv/bin/python -m benchmarks.adversarial fuzz --examples 1000 --api all
    .venv/bin/python -m benchmarks.adversarial load --sessions 32 --max-steps 16
    .venv/bin/python -m benchmarks.adversarial crash --cycles 10
    .venv/bin/python -m benchmarks.adversarial crash --cycles 10 --write-ahead
    .venv/bin/python -m benchmarks.adversarial crash --cycles 10 --summary-after

* ``fuzz``: fuzzed requests (``tests/support/fuzz_requests.py``) to each managed route
  (``--api``) on the fuzz suite's server; prints the answers by route and status; a 5xx fails.
* ``load``: ``--sessions`` real trajectories replayed at once, each its own
  session, under PaMER with a context budget small enough to compact; checks
  that each session's memories cover only its own blocks and that a request
  recalled only its own session's memories; prints errors, latency, and the
  API server's resident memory before, during and after.
* ``crash``: one session at a time replays a trajectory under PaMER with heads
  that always vote to compress; each cycle kills the whole server (SIGKILL) at
  a random point of a compaction (``during``: a random delay after the
  summary started; ``after commit``: as soon as the memory is committed,
  before the answer), then restarts it on the same store and checks: the
  store's integrity, no memory without its raw blocks nor a raw block without
  its memory, no block of the history lost (each one sent raw or stored under
  a memory), and the session going on. ``--write-ahead``: PaMER's budget
  schedule with ``write_ahead`` at a small budget, so ``during`` kills the
  server while a memory is written in the background and requests go on.
  ``--summary-after``: the budget schedule with ``summary_after``, so
  ``during`` kills the server while a committed memory's summary is written
  in the background (a random delay after ``compressed``: the compaction
  itself, which asks the engine for nothing, is not a kill point).

Each command exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from benchmarks._repo import DATA
from benchmarks._store_watch import Killer, isolation, last_event_id, lost_blocks, store_check
from vllm_pamer.core.heads import constant_heads, save_heads
from vllm_pamer.default_model import DEFAULT_MODEL_NAME, ensure_default_model, shipped_heads
from vllm_pamer.model_config import model_fingerprint
from vllm_pamer.replay.client import ReplaySettings, connect, plan_replay, replay_policy
from vllm_pamer.server_process import ServerProcess
from vllm_pamer.trajectories import agent_requests, load_or_sample


def serve(args: list[str], root: Path, name: str = "server.log") -> ServerProcess:
    """``vllm-pamer serve`` of the default model with its store in ``root``, ready."""
    server = ServerProcess(
        [*args, "--enforce-eager"], None, root / name, env={"PAMER_STORE": str(root / "memory.sqlite3")}
    )
    server.wait_ready(timeout=900, progress=False)
    return server


# -- fuzz --------------------------------------------------------------------------
def fuzz(args: argparse.Namespace) -> int:
    from hypothesis import given, seed

    from tests.support.fuzz_requests import (
        FUZZ_SERVER_ARGS,
        KEY,
        ROUTES,
        check_answer,
        fuzz_settings,
        fuzzed_requests,
        send,
    )
    from vllm_pamer.demo import ensure_demo_heads

    model_dir = ensure_default_model(quiet=True)
    apis = list(ROUTES) if args.api == "all" else args.api.split(",")
    statuses: dict[str, collections.Counter[int]] = {api: collections.Counter() for api in apis}
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = serve([*FUZZ_SERVER_ARGS, "--pamer-heads", str(ensure_demo_heads(model_dir))], Path(tmp))
        started = time.monotonic()
        try:
            with httpx.Client(base_url=server.base_url, timeout=300) as client:

                def route_test(api: str):  # one test per route (hypothesis takes no defaults)
                    @fuzz_settings(args.examples, derandomize=args.seed is None)
                    @given(fuzzed_requests(KEY, api))
                    def one(request):
                        response = send(client, request, api)
                        statuses[api][response.status_code] += 1
                        try:
                            check_answer(response, api)
                        except AssertionError as exc:
                            failures.append(f"{ROUTES[api]} {request!r}: {exc}")

                    return one if args.seed is None else seed(args.seed)(one)

                for api in apis:
                    route_test(api)()
                healthy = client.get("/health").status_code == 200
        finally:
            server.stop()
    total = sum(sum(counts.values()) for counts in statuses.values())
    print(f"{total} fuzzed requests in {time.monotonic() - started:.0f} s; server healthy after: {healthy}")
    print("| route | requests | 2xx | 4xx | 5xx |\n|---|---|---|---|---|")
    for api, counts in statuses.items():
        by = [sum(c for s, c in counts.items() if lo <= s < lo + 100) for lo in (200, 400, 500)]
        print(f"| `{ROUTES[api]}` | {sum(counts.values())} | {by[0]} | {by[1]} | {by[2]} |")
    print(f"failed checks: {len(failures)}")
    for failure in failures[:10]:
        print("  ", failure[:600])
    return 0 if healthy and not failures else 1


# -- load ----------------------------------------------------------------------------
def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def load(args: argparse.Namespace) -> int:
    ensure_default_model(quiet=True)
    heads = shipped_heads()
    trajectories = load_or_sample(DATA / "tau_airline.jsonl.gz", "tau") + load_or_sample(
        DATA / "mini_swe.jsonl.gz", "swe"
    )
    random.Random(0).shuffle(trajectories)
    plans = plan_replay(trajectories[: args.sessions], args.max_steps)
    if len(plans) < args.sessions:
        sys.exit(f"only {len(plans)} trajectories for {args.sessions} sessions")
    options = {"pamer_load": {"policy": "pamer", "context_budget": args.budget, "summary_max_tokens": 48}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = serve(
            [
                "--pamer-policy",
                "pamer",
                "--pamer-heads",
                str(heads),
                "--pamer-options-by-policy",
                json.dumps(options),
                "--enable-prompt-tokens-details",
            ],
            root,
        )
        rss = [("ready", rss_mib(server.proc.pid))]
        samples: list[tuple[float, float]] = []  # (seconds since the replay began, MiB)
        stop = threading.Event()
        started = time.monotonic()  # the replay's clock: its RSS samples and its length

        def sample() -> None:
            while not stop.wait(2.0):
                samples.append((time.monotonic() - started, rss_mib(server.proc.pid)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            settings = ReplaySettings(
                url=server.base_url, max_tokens=8, concurrency=args.sessions, timeout_s=1800.0, progress=True
            )

            async def run():
                async with connect(settings) as (client, model):
                    return await replay_policy(client, settings, model, "pamer_load", plans)

            records, _ = asyncio.run(run())
            elapsed = time.monotonic() - started
            rss.append(("after the replay", rss_mib(server.proc.pid)))
            healthy = httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        finally:
            stop.set()
            server.stop()
        sessions = isolation(root / "memory.sqlite3", plans, records)
    errors = [r for r in records if r.status != "ok"]
    latencies = sorted(r.latency_s for r in records if r.status == "ok")
    actions = collections.Counter((r.pamer or {}).get("action") for r in records)
    print(
        f"{len(plans)} sessions at once, {len(records)} requests in {elapsed:.0f} s "
        f"(context budget {args.budget}); actions {dict(actions)}"
    )
    print(f"errors: {len(errors)}" + "".join(f"\n   {e.session_id} step {e.step}: {e.error}" for e in errors[:5]))
    fallbacks = collections.Counter(
        f"{r.pamer['action']}: {r.pamer.get('detail', '')[:160]}"
        for r in records
        if r.pamer and str(r.pamer.get("action", "")).startswith("fallback:")
    )
    print("fallbacks (the request went out as it came):" + "".join(f"\n   {n} x {w}" for w, n in fallbacks.items()))
    if latencies:
        p95 = latencies[int(0.95 * (len(latencies) - 1))]
        print(f"latency: median {statistics.median(latencies):.1f} s, p95 {p95:.1f} s, max {latencies[-1]:.1f} s")
    peak = max((m for _, m in samples), default=rss[0][1])
    print("API server RSS (MiB): " + ", ".join(f"{w} {v:.0f}" for w, v in rss) + f", peak {peak:.0f}")
    # flat or growing: its median in each quarter of the replay
    quarters = [[m for t, m in samples if q * elapsed / 4 <= t < (q + 1) * elapsed / 4] for q in range(4)]
    print(
        "API server RSS, median of each quarter of the replay (MiB): "
        + ", ".join(f"{statistics.median(q):.0f}" if q else "-" for q in quarters)
    )
    compacted = sum(1 for s in sessions.values() if s["memories"])
    foreign = sum(s["foreign_blocks"] + s["foreign_recalls"] for s in sessions.values())
    print(
        f"sessions that compacted: {compacted} of {len(sessions)}; memories "
        f"{sum(s['memories'] for s in sessions.values())}; cross-session blocks or recalls: {foreign}; "
        f"server healthy after: {healthy}"
    )
    return 0 if not errors and not foreign and healthy and compacted else 1


# -- crash ---------------------------------------------------------------------------
def crash(args: argparse.Namespace) -> int:
    model_dir = ensure_default_model(quiet=True)
    rng = random.Random(args.seed)
    trajectories = [t for t in load_or_sample(DATA / "tau_airline.jsonl.gz", "tau") if len(t["messages"]) >= 30]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        heads = root / "always-compress.safetensors"
        save_heads(constant_heads(model_fingerprint(model_dir, DEFAULT_MODEL_NAME), 10.0), heads)
        options: dict[str, object] = {"summary_max_tokens": 48, "schedule": "paper"}
        if args.write_ahead:  # the budget schedule, its memories written in the background
            options = {"summary_max_tokens": 48, "write_ahead": True, "context_budget": args.budget}
        if args.summary_after:  # the budget schedule, its summaries written after their compactions
            options = {"summary_max_tokens": 48, "summary_after": True, "context_budget": args.budget}
        flags = ["--pamer-policy", "pamer", "--pamer-heads", str(heads), "--pamer-policy-options", json.dumps(options)]
        store = root / "memory.sqlite3"
        requests = [(t["id"], h) for t in trajectories for _, h in agent_requests(t["messages"])]
        position, failures, rows = 0, 0, []

        def post(client: httpx.Client, index: int) -> httpx.Response:
            trajectory_id, history = requests[index]
            return client.post(
                "/v1/chat/completions",
                json={"model": DEFAULT_MODEL_NAME, "messages": history, "max_tokens": 4, "temperature": 0},
                headers={"X-Session-ID": f"crash-{trajectory_id}", "X-Pamer-Echo": "1"},
            )

        server = serve(flags, root, "server-0.log")
        for cycle in range(1, args.cycles + 1):
            point = ("during", "after commit")[cycle % 2]  # both, alike often; the delay is random
            delay = rng.uniform(0.0, 3.0) if point == "during" else 0.0
            watch = "compressed" if args.summary_after else None  # its summary starts at the commit
            killer = Killer(server, store, point, delay, last_event_id(store), watch)
            killer.start()
            resend = None
            with httpx.Client(base_url=server.base_url, timeout=900) as client:
                while killer.fired is None and position < len(requests) - 1:
                    try:
                        response = post(client, position)
                    except httpx.HTTPError:
                        resend = position  # the kill cut this request: sent again after the restart
                        break
                    if response.status_code != 200 and killer.fired is None:
                        print(f"cycle {cycle}: HTTP {response.status_code} {response.text[:200]}")
                    position += 1
            killer.done.set()
            killer.join(timeout=5)
            server.kill()
            problems = store_check(store)
            # the restart on the same store; it serves the next cycle too
            server = serve(flags, root, f"server-{cycle}.log")
            index = position if resend is None else resend
            with httpx.Client(base_url=server.base_url, timeout=900) as client:
                response = post(client, index)
            trajectory_id, history = requests[index]
            continued = response.status_code == 200
            sent = response.json()["pamer"]["messages_sent"] if continued else []
            lost = lost_blocks(store, f"crash-{trajectory_id}", history, sent) if continued else -1
            problems += [] if continued else [f"after the restart: HTTP {response.status_code}"]
            problems += [f"{lost} blocks lost"] if lost > 0 else []
            failures += bool(problems)
            rows.append((cycle, killer.fired or "not fired (no compaction)", continued, lost, "; ".join(problems)))
            print(f"cycle {cycle}: kill {rows[-1][1]}; continued {continued}; lost blocks {lost}; {problems or 'ok'}")
            position = index + 1
        server.stop()
    print("\n| cycle | kill | session continued | blocks lost | problems |\n|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row[:4]) + f" | {row[4] or 'none'} |")
    fired = sum(1 for r in rows if not r[1].startswith("not fired"))
    print(f"\n{fired} kills of {len(rows)} cycles; cycles with a problem: {failures}")
    return 0 if failures == 0 and fired == len(rows) else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fuzz", help="fuzzed requests; no 5xx")
    p.add_argument("--examples", type=int, default=1000, help="fuzzed requests per route")
    p.add_argument(
        "--api", default="all", help="the routes' APIs, comma-separated (chat, responses, messages, invocations) or all"
    )
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: derandomized)")
    p = sub.add_parser("load", help="many sessions at once; isolation, latency, RSS")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument("--budget", type=int, default=4096, help="PaMER's context budget (small, so sessions compact)")
    p = sub.add_parser("crash", help="SIGKILL at random points of compaction, restart on the same store")
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument(
        "--write-ahead",
        action="store_true",
        help="the budget schedule with write_ahead: kills hit a memory written ahead",
    )
    p.add_argument(
        "--summary-after",
        action="store_true",
        help="the budget schedule with summary_after: kills hit a summary written after its compaction",
    )
    p.add_argument("--budget", type=int, default=3000, help="the context budget under --write-ahead / --summary-after")
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if getattr(args, "write_ahead", False) and getattr(args, "summary_after", False):
        parser.error("--write-ahead and --summary-after: choose one (under write_ahead, summary_after does nothing)")
    sys.exit({"fuzz": fuzz, "load": load, "crash": crash}[args.command](args))


if __name__ == "__main__":
    main()
