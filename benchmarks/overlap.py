"""PaMER synchronous vs overlap (summarize_ahead) mode of the paper's schedule,
measured side by side.

Serves the embedded default model with heads that always vote "compress",
replays one real tau-bench trajectory as an agent would (waiting
``--tool-seconds`` between requests, the time its tools take), once per mode,
and prints the latency of compressing requests, of all requests, and the
ratios sync / overlap measured in this run.

    .venv/bin/python -m benchmarks.overlap [--steps 20] [--tool-seconds 2] [--summary-max-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from vllm_pamer.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from vllm_pamer.server_process import ServerProcess
from vllm_pamer.trajectories import agent_requests, load_trajectories


def make_compress_heads(model_dir: Path, path: Path) -> Path:
    from vllm_pamer.core.heads import constant_heads, save_heads
    from vllm_pamer.model_config import model_fingerprint

    fingerprint = model_fingerprint(model_dir, DEFAULT_MODEL_NAME)
    save_heads(constant_heads(fingerprint, 10.0), path)
    return path


def run_mode(mode: str, args, heads: Path, workdir: Path, port: int) -> list[dict]:
    from openai import OpenAI
    from tqdm import tqdm

    # summarize_ahead is an option of the paper's schedule (the budget schedule writes no summary ahead)
    options = {"schedule": "paper", "summary_max_tokens": args.summary_max_tokens, "summarize_ahead": mode == "overlap"}
    server = ServerProcess(
        [
            "--pamer-policy",
            "pamer",
            "--pamer-policy-options",
            json.dumps(options),
            "--pamer-heads",
            str(heads),
            "--enforce-eager",
        ],
        port,
        workdir / f"{mode}.log",
        env={"PAMER_STORE": str(workdir / f"{mode}.sqlite3")},
    )
    rows = []
    try:
        server.wait_ready(progress=False)
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=600)
        trajectory = {t["id"]: t for t in load_trajectories(kind="tau")}[args.trajectory]
        requests_ = list(agent_requests(trajectory["messages"]))[: args.steps]
        for _, history in tqdm(requests_, desc=f"replay ({mode})"):
            start = time.perf_counter()
            response = client.chat.completions.create(
                model=DEFAULT_MODEL_NAME,
                messages=history,
                max_tokens=args.max_tokens,
                temperature=0,
                extra_headers={"X-Session-ID": f"bench-{mode}"},
            )
            latency = time.perf_counter() - start
            report = response.model_extra["pamer"]
            rows.append({"latency": latency, "action": report["action"], "detail": report["detail"]})
            time.sleep(args.tool_seconds)  # the agent runs its tools
    finally:
        server.stop()
    return rows


def summarize(rows: list[dict]) -> dict:
    compress = [r["latency"] for r in rows if r["action"] == "compressed"]
    return {
        "requests": len(rows),
        "compressions": len(compress),
        "ahead": sum("written ahead" in r["detail"] for r in rows),
        "compress_latency_s": statistics.mean(compress) if compress else float("nan"),
        "mean_latency_s": statistics.mean(r["latency"] for r in rows),
        "total_latency_s": sum(r["latency"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectory", default="airline-task2-trial1")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tool-seconds", type=float, default=2.0)
    parser.add_argument("--summary-max-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=8790)
    args = parser.parse_args()

    model_dir = ensure_default_model()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        heads = make_compress_heads(model_dir, workdir / "heads.safetensors")
        results = {mode: summarize(run_mode(mode, args, heads, workdir, args.port)) for mode in ("sync", "overlap")}
    print(
        f"\ntrajectory {args.trajectory}, {args.steps} requests, tool time {args.tool_seconds} s, "
        f"summary <= {args.summary_max_tokens} tokens, heads always vote compress\n"
    )
    print(
        "| mode | requests | compressions | written ahead | compressing request latency (s) | mean latency (s) | "
        "sum of latencies (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(
            f"| {mode} | {r['requests']} | {r['compressions']} | {r['ahead']} | {r['compress_latency_s']:.2f} | "
            f"{r['mean_latency_s']:.2f} | {r['total_latency_s']:.1f} |"
        )
    sync, overlap = results["sync"], results["overlap"]
    print(
        "\nratio sync/overlap: compressing-request latency "
        f"{sync['compress_latency_s'] / overlap['compress_latency_s']:.2f}x, "
        f"sum of latencies {sync['total_latency_s'] / overlap['total_latency_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
