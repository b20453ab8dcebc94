"""A model of a policy's serving cost and evidence, without an engine: for
choosing schedule settings in seconds before measuring them on a server.

Each request of the replayed trajectories goes through the policy as the
server would run it (``core/pipeline.py``), counted by the default model's own
tokenizer and chat template. Prefill is modelled as vLLM's prefix cache would
serve it: what a request shares with the session's previous one (whole
messages, rounded down to ``--block`` tokens) is cached, the rest computed;
a summary request in the ``conversation`` layout computes its last turn only,
in the ``text`` layout its whole source. The engine is replaced: summaries
are a fixed sentence with no exact value (the 135M model keeps few), the
embeddings hash words, the vote says compress with probability ``--vote-p``.
So the evidence column is what the schedule and the record keep by
themselves. Printed: one line per policy; measured figures come from
``benchmarks/policies.py`` (benchmarks/RESULTS.md compares the two).

    .venv/bin/python -m benchmarks.schedule_sim --kind swe --n 8 --max-steps 30
    .venv/bin/python -m benchmarks.schedule_sim --kind swe --offset 16 --pool 32 --n 32  # off the run's own
    .venv/bin/python -m benchmarks.schedule_sim --kind tau --n 12 --policies none,recent_k,pamer \\
        --options '{"pamer": {"target_share": 0.5, "band_share": 0.25}}'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.policies import DATA, policy_options
from vllm_pamer.core.blocks import Message
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import HeadVote, PolicyContext, create_policy
from vllm_pamer.core.policies.pamer.budget_schedule import BudgetSchedule
from vllm_pamer.core.render import render_tools_as_text
from vllm_pamer.core.tokens import TokenCounter
from vllm_pamer.default_model import ensure_default_model
from vllm_pamer.replay.evidence import (
    available_count,
    context_chars,
    evidence_messages,
    needed_values,
    recency_at,
    recency_frontier,
    trajectory_kind,
)
from vllm_pamer.stores.sqlite import SqliteStore
from vllm_pamer.trajectories import agent_requests, load_trajectories

SUMMARY = "The agent worked on the task and made progress. "
COMPRESS = HeadVote((5.0,) * 5, 5, True)
KEEP = HeadVote((-5.0,) * 5, 0, False)


class ModelEngine:
    """The engine contract (``core/engine.py``) with the real tokenizer and a
    count of the summary requests' modelled prefill."""

    embedder_name = "hashed-words"

    def __init__(
        self, counter: TokenCounter, window: int, kv_usage: float | None = None, kv_capacity: int | None = None
    ) -> None:
        self.counter, self.max_model_len, self.kv, self.capacity = counter, window, kv_usage, kv_capacity
        self.summary_prefill = 0

    def count_tokens(self, messages: Sequence[Message]) -> int:
        return self.counter.span(messages)

    def prompt_tokens(self, messages: Sequence[Message], tools=None) -> int:
        return self.counter.request(messages, tools)

    async def summarize(self, source: str, max_tokens: int) -> str:
        self.summary_prefill += len(self.counter.tokenizer.encode(source, add_special_tokens=False))
        return SUMMARY * 10

    async def summarize_conversation(self, messages: Sequence[Message], max_tokens: int) -> str | None:
        if self.counter.request(messages) >= self.max_model_len - max_tokens:
            return None
        self.summary_prefill += self.counter.span(messages[-1:])  # its prefix is the previous request's
        return SUMMARY * 10

    async def complete(self, messages, max_tokens, json_schema=None, kind="internal") -> str:
        return SUMMARY

    async def embed(self, text: str) -> np.ndarray:
        vector = np.zeros(64, dtype=np.float32)
        for word in text.split():
            vector[int(hashlib.md5(word.encode()).hexdigest(), 16) % 64] += 1
        return vector

    def kv_usage(self) -> float | None:
        return self.kv

    def kv_capacity(self) -> int | None:
        return self.capacity

    def summary_slot(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()  # one request at a time: no turns to wait for

    def sync_memories(self, session, memories, held=()):
        pass  # recall runs here, on the host


def _steps(trajectory: dict, max_steps: int):
    """(trajectory, index of the next action, history, kind) per request replayed."""
    kind = trajectory_kind(trajectory)
    for step, (index, history) in enumerate(agent_requests(trajectory["messages"])):
        if max_steps and step >= max_steps:
            return
        yield trajectory, index, history, kind


def simulate(policy_name: str, options: dict, trajectories: list[dict], args: argparse.Namespace, counter) -> dict:
    engine = ModelEngine(counter, args.window, args.kv_usage, args.kv_capacity)
    policy = create_policy(options.get("policy", policy_name), {k: v for k, v in options.items() if k != "policy"})
    with tempfile.TemporaryDirectory() as tmp:
        context = PolicyContext(SqliteStore(Path(tmp) / "memory.sqlite3"), engine)
        votes = random.Random(args.seed)
        needed = available = chars_in = chars_out = compactions = refused = prefill = fallbacks = 0
        steps = [_steps(t, args.max_steps) for t in trajectories]
        now = [0.0]  # modelled seconds: each round of requests takes --round-s (kv_share's idle time)
        schedule = getattr(policy, "schedule", None)
        if isinstance(schedule, BudgetSchedule):  # its sessions' activity (kv_share) on the modelled clock
            schedule.clock = lambda: now[0]
        previous: dict[int, list[Message]] = {}
        # --side-by-side sessions at a time, one request each in turn (as the server sees them)
        for batch in range(0, len(steps), args.side_by_side):
            running = list(range(batch, min(batch + args.side_by_side, len(steps))))
            while running:
                now[0] += args.round_s
                for n in list(running):
                    item = next(steps[n], None)
                    if item is None:
                        running.remove(n)
                        continue
                    trajectory, index, history, kind = item
                    vote = COMPRESS if votes.random() < args.vote_p else KEEP
                    out = asyncio.run(
                        rewrite_request(
                            history,
                            f"{trajectory['id']}@{id(trajectory)}",
                            policy,
                            vote,
                            context,
                            prompt_tokens=counter.request(history),
                        )
                    )
                    compactions += out.action == "compressed"
                    fallbacks += out.action.startswith("fallback:")  # a broken model engine shows here
                    sent = out.messages
                    values = needed_values(history, trajectory["messages"][index], kind)
                    needed += len(values)
                    chars_in += context_chars(history)
                    tokens = counter.request(sent)
                    if tokens >= args.window:
                        refused, previous[n] = refused + 1, []
                        continue
                    last, common = previous.get(n, []), 0
                    while common < min(len(last), len(sent)) and last[common] == sent[common]:
                        common += 1
                    cached = counter.request(sent[:common]) if common else 0
                    prefill += tokens - (min(cached, tokens - 1) // args.block) * args.block
                    previous[n] = sent
                    available += available_count(values, evidence_messages(sent, history, kind))
                    chars_out += context_chars(sent)
    share = chars_out / chars_in if chars_in else 0.0
    recency = recency_at(recency_frontier(trajectories, range(1, 40), args.max_steps or None), share)
    evidence = available / needed if needed else 0.0
    return {
        "prefill": prefill + engine.summary_prefill,
        "summary_prefill": engine.summary_prefill,
        "compactions": compactions,
        "refused": refused,
        "fallbacks": fallbacks,
        "evidence": round(evidence, 3),
        "chars_share": round(share, 3),
        "over_recency_pt": round(100 * (evidence - recency), 1) if recency is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("tau", "swe"), default="swe")
    parser.add_argument("--n", type=int, default=8, help="trajectories (the first N of the file, shuffled by --seed)")
    parser.add_argument(
        "--pool", type=int, default=16, help="mini-swe: draw from the first N, as benchmarks.policies --swe"
    )
    parser.add_argument(
        "--offset",
        type=int,
        default=0,
        help="skip the first N trajectories (16: settings chosen off the benchmark's own)",
    )
    parser.add_argument("--max-steps", type=int, default=30, help="first N requests of each trajectory (0: all)")
    parser.add_argument("--policies", default="recent_k,pamer")
    parser.add_argument("--options", default="{}", help="JSON: per policy, options over benchmarks.policies' own")
    parser.add_argument(
        "--side-by-side", type=int, default=1, help="sessions at a time, one request each in turn (kv_share)"
    )
    parser.add_argument(
        "--round-s", type=float, default=20.0, help="modelled seconds between a session's requests (kv_share)"
    )
    parser.add_argument("--vote-p", type=float, default=0.8, help="chance the heads vote compress")
    parser.add_argument("--window", type=int, default=8192)
    parser.add_argument(
        "--kv-usage", type=float, default=None, help="KV-cache usage (0-1) every request sees (default: unknown)"
    )
    parser.add_argument(
        "--kv-capacity", type=int, default=None, help="tokens the KV cache holds (kv_share; default: unknown)"
    )
    parser.add_argument("--block", type=int, default=128, help="KV block size (vLLM's CPU default)")
    parser.add_argument("--summary-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    counter = TokenCounter(AutoTokenizer.from_pretrained(str(ensure_default_model(quiet=True))), render_tools_as_text)
    name = "tau_airline" if args.kind == "tau" else "mini_swe"
    loaded = load_trajectories(DATA / f"{name}.jsonl.gz")
    loaded = loaded[args.offset :]
    pool = loaded[: args.pool] if args.kind == "swe" else loaded
    trajectories = random.Random(args.seed).sample(pool, len(pool))[: args.n]
    known, extra = policy_options(args.summary_tokens), json.loads(args.options)
    for policy in args.policies.split(","):
        options = {**known.get(policy, {}), **extra.get(policy, {})}
        print(policy, json.dumps(simulate(policy, options, trajectories, args, counter)), flush=True)


if __name__ == "__main__":
    main()
