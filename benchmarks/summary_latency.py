"""How long one summary-sized request takes on this machine: what
``summary_timeout_s`` (``core/policies/summary_writer.py``) must allow a healthy engine.

    .venv/bin/python -m benchmarks.summary_latency                          # 2,000 / 4,000 / 7,500 tokens
    .venv/bin/python -m benchmarks.summary_latency --tokens 7500 --repeats 3

Starts ``vllm-pamer serve`` of the default model with policy ``none`` (no
rewrite, so the engine's own time is measured), then sends chat requests of
about ``--tokens`` prompt tokens each, ``--max-tokens`` answer tokens (a
summary's output limit in the end-to-end tests), every one a fresh text so no
prefix is cached: a summary request of a session whose prefix left the cache.
Prints prompt tokens, answer tokens and seconds per request.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import httpx

from vllm_pamer.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from vllm_pamer.server_process import ServerProcess

WORDS = [
    "flight",
    "reservation",
    "passenger",
    "cabin",
    "economy",
    "baggage",
    "refund",
    "payment",
    "card",
    "date",
    "airport",
]


def fresh_text(tokens: int, rng: random.Random) -> str:
    """About ``tokens`` tokens of text no earlier request began with."""
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 999)}" for _ in range(tokens // 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2000,4000,7500", help="prompt sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="requests per size")
    parser.add_argument("--max-tokens", type=int, default=48, help="answer tokens of each request")
    args = parser.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    ensure_default_model()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            ["--pamer-policy", "none", "--enforce-eager"],
            None,
            Path(tmp) / "server.log",
            env={"PAMER_STORE": str(Path(tmp) / "memory.sqlite3")},
        )
        try:
            server.wait_ready()
            print("prompt tokens  answer tokens  seconds")
            for size in sizes:
                for _ in range(args.repeats):
                    body = {
                        "model": DEFAULT_MODEL_NAME,
                        "messages": [{"role": "user", "content": fresh_text(size, rng)}],
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                    }
                    start = time.monotonic()
                    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=1800)
                    response.raise_for_status()
                    usage = response.json()["usage"]
                    seconds = time.monotonic() - start
                    print(f"{usage['prompt_tokens']:>13}  {usage['completion_tokens']:>13}  {seconds:7.1f}", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
