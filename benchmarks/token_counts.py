"""How long one token count of a request's history takes: one pass of the
served chat template and tokenizer over the whole history, tools included
(``EngineServices.prompt_tokens``). A policy that counts a whole history, e.g.
SAM's trigger, pays this on the API server's event loop, where the policies
run; the server's own count of each request (which PaMER's window guard reuses)
runs in a worker thread. Prints the median, p90 and max per request kind.

    .venv/bin/python benchmarks/token_counts.py                 # 6 trajectories per kind, 30 requests each

Data: ``../shared`` trajectories where they exist, else the shipped samples.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoTokenizer  # noqa: E402

from benchmarks.policies import shared_or_shipped  # noqa: E402
from vllm_pamer.channel import CaptureInbox  # noqa: E402
from vllm_pamer.default_model import ensure_default_model  # noqa: E402
from vllm_pamer.server.engine_services import EngineServices  # noqa: E402
from vllm_pamer.trajectories import agent_requests  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=6, help="per kind")
    parser.add_argument("--steps", type=int, default=30, help="requests per trajectory")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model(quiet=True)))
    services = EngineServices(None, tokenizer, CaptureInbox("ipc://unused"), max_model_len=8192)
    print("| requests | count | prompt tokens, median / max | ms, median | ms, p90 | ms, max |\n|---|---|---|---|---|---|")
    for kind, name in (("tau", "tau_airline"), ("swe", "mini_swe")):
        trajectories = shared_or_shipped(name, kind)[: args.trajectories]
        seconds, tokens = [], []
        for trajectory in trajectories:
            for _, history in list(agent_requests(trajectory["messages"]))[: args.steps]:
                start = time.perf_counter()
                tokens.append(services.prompt_tokens(history, trajectory.get("tools")))
                seconds.append(time.perf_counter() - start)
        ms = sorted(1e3 * s for s in seconds)
        print(f"| {name} | {len(ms)} | {statistics.median(tokens):,.0f} / {max(tokens):,} | "
              f"{statistics.median(ms):.1f} | {ms[int(0.9 * (len(ms) - 1))]:.1f} | {ms[-1]:.1f} |")


if __name__ == "__main__":
    main()
