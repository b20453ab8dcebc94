"""Serving overhead of the plugin: the same replay against (a) plain vLLM
without the plugin (``vllm-pamer serve --pamer-off``) and (b) the plugin with
capture and the five-head vote on and policy ``none``, in interleaved A/B
rounds (a b b a, so a linear drift of the machine cancels), each round on a
freshly started server with the same flags. Prints each round and the
throughput ratio b/a.

    .venv/bin/python -m benchmarks.overhead                      # 2 rounds, 4 trajectories
    .venv/bin/python -m benchmarks.overhead --rounds 3 --trajectories 8 --concurrency 4

Workload: the first ``--steps`` requests of ``--trajectories`` shipped tau-bench
trajectories, as an agent sends them (whole history each step), ``--concurrency``
sessions at a time, greedy, ``--max-tokens`` each. Throughput = requests per
second of wall time over the whole workload (prompt tokens per second is
printed too). The goal is b/a >= 0.99.

``--prompts same`` (default) measures the plugin at equal work: the plugin
writes tool calls out as text for a chat template that drops them
(``core/render.py``), so plain vLLM is sent the histories so rendered, and both
sides prefill the same prompts (the printed prompt tokens show it).
``--prompts as-sent`` sends both the agent's own messages, as a user sees it.

``--pin-frontend`` (default on CPU) keeps each server's API and engine-core
processes off the cores vLLM bound its worker to: vLLM's CPU backend binds the
worker's threads and reserves the other cores for everything else
(``VLLM_CPU_OMP_THREADS_BIND=auto``), but the other processes still float onto
the worker's core and stall the model by chance, which moved single rounds by
up to a tenth on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import httpx
import psutil
from tqdm import tqdm
from transformers import AutoTokenizer

from benchmarks._rounds import interleaved_rounds
from vllm_pamer.core.render import render_tools_as_text, template_supports_tools
from vllm_pamer.default_model import DEFAULT_MODEL_NAME, ensure_default_model, shipped_heads
from vllm_pamer.demo import ensure_demo_heads
from vllm_pamer.server_process import ServerProcess
from vllm_pamer.trajectories import agent_requests, load_trajectories


async def workload(
    url: str, sessions: list[list[list[dict]]], concurrency: int, max_tokens: int
) -> tuple[float, int, int]:
    """Seconds, requests and prompt tokens for the whole workload."""
    gate = asyncio.Semaphore(concurrency)
    prompt_tokens = 0

    async def one_session(index: int, steps: list[list[dict]], client: httpx.AsyncClient) -> int:
        nonlocal prompt_tokens
        async with gate:
            for history in steps:
                body = {"model": DEFAULT_MODEL_NAME, "messages": history, "max_tokens": max_tokens, "temperature": 0}
                response = await client.post(
                    f"{url}/v1/chat/completions", json=body, headers={"X-Session-ID": f"overhead-{index}"}
                )
                response.raise_for_status()
                prompt_tokens += response.json()["usage"]["prompt_tokens"]
        return len(steps)

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(one_session(i, s, client) for i, s in enumerate(sessions)))
        return time.perf_counter() - start, sum(done), prompt_tokens


def pin_frontend(server: ServerProcess) -> str:
    """Pin every thread of the server's processes but its workers' to the cores
    the workers are not bound to; says what it did."""
    tree = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    workers = [p for p in tree if "Worker" in p.name()]
    worker_cores = {core for p in workers for t in p.threads() for core in os.sched_getaffinity(t.id)}
    free = set(range(psutil.cpu_count() or 1)) - worker_cores
    if not workers or not free:
        return "not pinned (no free core)"
    for process in tree:
        if process not in workers:
            for thread in process.threads():
                os.sched_setaffinity(thread.id, free)
    return f"frontend on cores {sorted(free)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side (default %(default)s)")
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="requests per trajectory")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--serve-args", default="--enforce-eager", help="extra vLLM flags for both servers")
    parser.add_argument(
        "--pin-frontend", action=argparse.BooleanOptionalAction, default=True, help="see the module doc"
    )
    parser.add_argument("--prompts", choices=("same", "as-sent"), default="same", help="see the module doc")
    args = parser.parse_args()

    model_dir = ensure_default_model(quiet=True)
    heads = shipped_heads() or ensure_demo_heads(model_dir)
    trajectories = load_trajectories(kind="tau")[: args.trajectories]
    sessions = [[h for _, h in agent_requests(t["messages"])][: args.steps] for t in trajectories]
    plain = sessions
    if args.prompts == "same" and not template_supports_tools(AutoTokenizer.from_pretrained(model_dir).chat_template):
        plain = [[render_tools_as_text(h) for h in steps] for steps in sessions]
    by_side_sessions = (plain, sessions)
    sides = (
        ("a: plain vLLM", ["--pamer-off"]),
        ("b: plugin, capture + vote, policy none", ["--pamer-policy", "none", "--pamer-heads", str(heads)]),
    )

    def start(side: int, log: Path) -> ServerProcess:
        return ServerProcess([*sides[side][1], *args.serve_args.split()], None, log)

    def measure(side: int, server: ServerProcess) -> tuple[float, int, int]:
        mine = by_side_sessions[side]
        if args.pin_frontend:
            tqdm.write(f"{sides[side][0]}: {pin_frontend(server)}")
        asyncio.run(workload(server.base_url, mine[:1], 1, args.max_tokens))  # warm-up
        return asyncio.run(workload(server.base_url, mine, args.concurrency, args.max_tokens))

    def describe(side: int, result: tuple[float, int, int]) -> str:
        seconds, requests, prompt = result
        return (
            f"{sides[side][0]}: {requests} requests in {seconds:.2f} s "
            f"({requests / seconds:.3f} req/s, {prompt / seconds:.0f} prompt tok/s)"
        )

    by_side, logs = interleaved_rounds(args.rounds, start, measure, describe, "overhead-")
    results = {name: by_side[side] for side, (name, _) in enumerate(sides)}

    print("\n| server | rounds | req/s (median) | prompt tok/s (median) |\n|---|---|---|---|")
    rates = {}
    for name, runs in results.items():
        rates[name] = statistics.median(r / s for s, r, _ in runs)
        print(f"| {name} | {len(runs)} | {rates[name]:.3f} | {statistics.median(p / s for s, _, p in runs):.0f} |")
    a, b = rates.values()
    pairs = [rb[1] / rb[0] / (ra[1] / ra[0]) for ra, rb in zip(*results.values())]
    print(f"\nthroughput b/a: {b / a:.3f} (median of rates); per round: {', '.join(f'{p:.3f}' for p in pairs)}")
    print(
        f"workload: {len(sessions)} trajectories x {args.steps} steps, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, prompts {args.prompts}; server logs in {logs}"
    )


if __name__ == "__main__":
    main()
