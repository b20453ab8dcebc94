"""A model of a policy's serving cost and evidence, without an engine: for
choosing schedule settings in seconds before measuring them on a server
(``benchmarks/schedule_sim.py`` is its command line).

Each request of the replayed trajectories goes through the policy as the
server would run it (``core/pipeline.py``), counted by the served model's own
tokenizer and chat template. Prefill is modelled as vLLM's prefix cache would
serve it: what a request shares with the session's previous one (whole
messages, rounded down to ``ModelSettings.block`` tokens) is cached, the rest
computed; a summary request in the ``conversation`` layout computes its last
turn only, in the ``text`` layout its whole source. The engine is replaced
(``ModelEngine``): summaries are a fixed sentence with no exact value (the
135M model keeps few), the embeddings hash words, the vote says compress with
probability ``vote_p``. So the evidence is what the schedule and the record
keep by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from vllm_pamer.core.blocks import Message
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import HeadVote, PolicyContext, PolicyRequest, create_policy
from vllm_pamer.core.policies.pamer.budget_schedule import BudgetSchedule
from vllm_pamer.core.tokens import TokenCounter
from vllm_pamer.replay.evidence import (
    Reading,
    available_count,
    context_chars,
    dropped_observation_chars,
    evidence_messages,
    needed_values,
    needs,
    readings,
    recency_at,
    recency_frontier,
    trajectory_kind,
)
from vllm_pamer.replay.spending import inserted_spending
from vllm_pamer.stores.sqlite import SqliteStore
from vllm_pamer.trajectories import agent_requests

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


class ModelSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How the model serves the replayed requests."""

    max_steps: int = 30
    """First N requests of each trajectory (0: all)."""
    vote_p: float = 0.8
    """The chance the heads vote compress at a request."""
    seed: int = 0
    """Seeds the votes."""
    window: int = 8192
    """The served window in tokens: a request that reaches it is refused."""
    block: int = 128
    """KV block size: the prefix cache serves whole blocks (vLLM's CPU default)."""
    kv_usage: float | None = None
    """KV-cache usage (0-1) every request sees (None: unknown)."""
    kv_capacity: int | None = None
    """Tokens the KV cache holds (``kv_share``; None: unknown)."""
    side_by_side: int = 1
    """Sessions at a time, one request each in turn (as the server sees them)."""
    round_s: float = 20.0
    """Modelled seconds between a session's requests (``kv_share``'s idle time)."""
    context_budget: int | None = None
    """The context budget every request sets (``X-Pamer-Context-Budget``, as
    ``benchmarks.policies --context-budget``): every policy with a budget at
    the same one. None: each policy's own."""


def simulate(
    policy_name: str,
    options: dict[str, Any],
    trajectories: list[dict[str, Any]],
    settings: ModelSettings,
    counter: TokenCounter,
) -> dict[str, Any]:
    """One policy over ``trajectories`` on the model: prefill computed (the
    summaries' included), compactions, refusals, fallbacks, evidence and its
    lead over recency at the same character share."""
    engine = ModelEngine(counter, settings.window, settings.kv_usage, settings.kv_capacity)
    policy = create_policy(options.get("policy", policy_name), {k: v for k, v in options.items() if k != "policy"})
    # one event loop for the whole run: a memory written ahead (write_ahead) is a task of it
    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory() as tmp, contextlib.closing(loop):
        context = PolicyContext(SqliteStore(Path(tmp) / "memory.sqlite3"), engine)
        votes = random.Random(settings.seed)
        needed = available = chars_in = chars_out = compactions = refused = prefill = fallbacks = 0
        wanted = readable = observed = 0  # the one rule (evidence.needs, evidence.readings)
        answered = dropped = 0  # observation characters not sent as they are (what a memory stands in for)
        spent: dict[str, int] = {}  # inserted characters by part (spending.inserted_spending)
        steps = [_steps(t, settings.max_steps) for t in trajectories]
        now = [0.0]  # modelled seconds: each round of requests takes --round-s (kv_share's idle time)
        schedule = getattr(policy, "schedule", None)
        if isinstance(schedule, BudgetSchedule):  # its sessions' activity (kv_share) on the modelled clock
            schedule.clock = lambda: now[0]
        previous: dict[int, list[Message]] = {}
        # --side-by-side sessions at a time, one request each in turn (as the server sees them)
        for batch in range(0, len(steps), settings.side_by_side):
            running = list(range(batch, min(batch + settings.side_by_side, len(steps))))
            while running:
                now[0] += settings.round_s
                for n in list(running):
                    item = next(steps[n], None)
                    if item is None:
                        running.remove(n)
                        continue
                    trajectory, index, history, kind = item
                    vote = COMPRESS if votes.random() < settings.vote_p else KEEP
                    out = loop.run_until_complete(
                        rewrite_request(
                            policy,
                            PolicyRequest(
                                messages=history,
                                session_id=f"{trajectory['id']}@{id(trajectory)}",
                                previous_vote=vote,
                                context=context,
                                prompt_tokens=counter.request(history),
                                context_budget=settings.context_budget,
                            ),
                        )
                    )
                    later = getattr(schedule, "later", None)
                    if later is not None:  # summaries after their compaction land before the next step
                        loop.run_until_complete(later.drain())
                    compactions += out.action == "compressed"
                    fallbacks += out.action.startswith("fallback:")  # a broken model engine shows here
                    sent = out.messages
                    values = needed_values(history, trajectory["messages"][index], kind)
                    needed += len(values)
                    fair = needs(history, trajectory["messages"][index], kind)
                    wanted += len(fair)
                    tokens = counter.request(sent)
                    if tokens >= settings.window:  # refused: its needs count, unread; its characters do not
                        refused, previous[n] = refused + 1, []
                        continue
                    chars_in += context_chars(history)
                    last, common = previous.get(n, []), 0
                    while common < min(len(last), len(sent)) and last[common] == sent[common]:
                        common += 1
                    cached = counter.request(sent[:common]) if common else 0
                    prefill += tokens - (min(cached, tokens - 1) // settings.block) * settings.block
                    previous[n] = sent
                    available += available_count(values, evidence_messages(sent, history, kind))
                    read = readings(fair, sent, history)
                    readable, observed = readable + read.readable, observed + read.observed
                    chars_out += context_chars(sent)
                    answered, dropped = answered + 1, dropped + dropped_observation_chars(sent, history)
                    for part, chars in inserted_spending(sent, history).items():
                        spent[part] = spent.get(part, 0) + chars
    share = chars_out / chars_in if chars_in else 0.0
    frontier = recency_frontier(trajectories, range(1, 40), settings.max_steps or None)
    evidence = available / needed if needed else 0.0

    def lead(value: float, reading: Reading) -> float | None:
        recency = recency_at(frontier, share, reading)
        return round(100 * (value - recency), 1) if recency is not None else None

    fair_readable, fair_observed = (readable / wanted, observed / wanted) if wanted else (0.0, 0.0)
    return {
        "prefill": prefill + engine.summary_prefill,
        "summary_prefill": engine.summary_prefill,
        "compactions": compactions,
        "refused": refused,
        "fallbacks": fallbacks,
        "evidence": round(evidence, 3),
        "chars_share": round(share, 3),
        "over_recency_pt": lead(evidence, "one_sided"),  # the one-sided rule
        "readable": round(fair_readable, 3),
        "readable_over_recency_pt": lead(fair_readable, "readable"),
        "observed": round(fair_observed, 3),
        "observed_over_recency_pt": lead(fair_observed, "observed"),
        "inserted_chars": sum(spent.values()),
        # per answered request: the memory's characters against the observations' it stands in for
        "inserted_chars_per_request": round(sum(spent.values()) / answered) if answered else 0,
        "dropped_observation_chars_per_request": round(dropped / answered) if answered else 0,
        "spending": {part: round(chars / sum(spent.values()), 3) for part, chars in spent.items() if chars},
    }
