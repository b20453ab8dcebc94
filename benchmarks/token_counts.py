"""How long one token count of a request's history takes: one pass of the
served chat template and tokenizer over the whole history, tools included
(``core.tokens.TokenCounter.request``). A policy that counts a whole history, e.g.
SAM's trigger, pays this on the API server's event loop, where the policies
run; the server's own count of each request (which PaMER's window guard reuses)
runs in a worker thread. Prints the median, p90 and max per request kind.

    .venv/bin/python -m benchmarks.token_counts                 # 6 trajectories per kind, 30 requests each

Data: ``../shared`` trajectories where they exist, else the shipped samples.
"""

from __future__ import annotations

import argparse
import statistics
import time

from transformers import AutoTokenizer

from benchmarks._repo import DATA
from vllm_pamer.core.render import render_tools_as_text, template_supports_tools
from vllm_pamer.core.tokens import TokenCounter
from vllm_pamer.default_model import ensure_default_model
from vllm_pamer.trajectories import agent_requests, load_or_sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=6, help="per kind")
    parser.add_argument("--steps", type=int, default=30, help="requests per trajectory")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model(quiet=True)))
    # rendered as the server renders an agent's messages for this template
    as_text = not template_supports_tools(tokenizer.chat_template)
    counter = TokenCounter(tokenizer, render=render_tools_as_text if as_text else None)
    print(
        "| requests | count | prompt tokens, median / max | ms, median | ms, p90 | ms, max |\n|---|---|---|---|---|---|"
    )
    for kind, name in (("tau", "tau_airline"), ("swe", "mini_swe")):
        trajectories = load_or_sample(DATA / f"{name}.jsonl.gz", kind)[: args.trajectories]
        seconds, tokens = [], []
        for trajectory in trajectories:
            for _, history in list(agent_requests(trajectory["messages"]))[: args.steps]:
                start = time.perf_counter()
                tokens.append(counter.request(history, trajectory.get("tools")))
                seconds.append(time.perf_counter() - start)
        ms = sorted(1e3 * s for s in seconds)
        print(
            f"| {name} | {len(ms)} | {statistics.median(tokens):,.0f} / {max(tokens):,} | "
            f"{statistics.median(ms):.1f} | {ms[int(0.9 * (len(ms) - 1))]:.1f} | {ms[-1]:.1f} |"
        )


if __name__ == "__main__":
    main()
