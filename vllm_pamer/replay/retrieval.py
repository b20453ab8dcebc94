"""The retrieval check that ``benchmarks/retrieval.py`` runs: which embedder
recalls the memory that holds a needed value? PaMER's archiving is replayed
along a tau-bench trajectory and, whenever the agent needs a value that only an
archived memory still holds, cosine Top-K recall is scored on bringing it
back. Pure: the caller embeds the texts.

The check, precisely
--------------------
For every trajectory and every agent request t (``agent_requests``: the history
``messages[:i]`` before assistant message i):

1. Split (``split_conversation``): P = prefix (system + task), blocks; R = the
   last ``--retained`` (2) blocks, old = the blocks before R.
2. Archive: whenever >= ``--group`` (3) old blocks are not yet archived, they
   all become one new memory (blocks are stable across requests, so with one
   new block per request memories hold 3 consecutive blocks). The memory text
   is ``serialize_messages`` of its blocks capped to ``--memory-chars`` (2,000)
   characters from its beginning and end (``cap_head_and_tail``). This raw,
   truncated text is a STAND-IN for the LLM summary PaMER would write
   (a ``--summaries`` mode that summarizes with the served model is left for
   later). Archiving happens before recall at t, so a memory made at t is
   already recallable at t.
3. If t has >= ``--min-memories`` (2) memories, its candidate values are
   * every argument value of the trajectory's ``ground_truth_actions`` (the
     tool calls the task requires; origin "task"), and
   * every argument value of the tool calls in assistant message i, the
     agent's next message (origin "next"; a task value that appears anywhere
     in message i, text or call arguments, is also "next"),
   where values are the strings and numbers of ``kwargs`` flattened through
   lists and dicts (booleans and None dropped, integral floats written as
   ints), keeping those of >= ``--min-value-len`` (3) characters: reservation
   ids, user ids, flight numbers, dates, airport codes, payment ids, prices...
4. A candidate becomes a case (t, value) when it occurs (exact, case-sensitive
   substring) in at least one memory's text but NOT in serialize(P) or
   serialize(R): the agent can get it back only from memory. (The <= 2 old
   blocks not yet archived are also sent raw by PaMER; by default they do not
   disqualify a value, as the brief defines it; ``--exclude-old`` makes them
   disqualify it too.) The memories that contain the value are its relevant
   memories.
5. Query = ``serialize_messages(P[-1:] + R)``, last ``--query-chars``
   (30,000) characters - exactly PaMER's recall query (task + R).
   Memories are ranked by cosine(query, memory) descending, ties to the older
   memory (``cosine_top_k``'s order).

Per method: cases; hit@1 and hit@3 (a relevant memory is ranked first / in the
Top-3); MRR (1 / rank of the best-ranked relevant memory); hit@3 on the cases
with more than 3 memories (with <= 3 memories Top-3 returns them all, so hit@3
is 1 for every method there - read hit@1 and MRR). Baselines: "random" is the
exact expectation of a uniformly random ranking (hit@3 = 1 - C(n-r,3)/C(n,3)
for n memories of which r are relevant; hit@1 = r/n; MRR exact), "recency"
ranks the newest memories first. The 95% intervals resample whole trajectories
(cases of one trajectory are correlated). Embedding throughput is texts per
second over the deduplicated memory and query texts (model load or engine
start not included; shown separately).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.core.render import render_tools_as_text, template_supports_tools
from vllm_pamer.core.text import cap_head_and_tail, serialize_messages
from vllm_pamer.trajectories import agent_requests


@dataclass(frozen=True)
class CheckConfig:
    group: int = 3
    retained: int = 2
    memory_chars: int = 2000
    query_chars: int = 30_000
    min_memories: int = 2
    min_value_len: int = 3
    exclude_old: bool = False


@dataclass
class Case:
    trajectory: str
    message_index: int
    """Index i of the assistant message the agent was about to write."""
    value: str
    origin: str
    """"next" (in the agent's next message) or "task" (only in ground_truth_actions)."""
    n_memories: int
    relevant: tuple[int, ...]
    """Ids (positions in the trajectory's memory list) of the memories holding the value."""
    query: str
    previous_request: list | None = None
    """The messages PaMER sent at the previous request (P, the un-archived old
    blocks and R, without the memory message it showed): the prompt whose
    captured state is the deferred query (``query_source="captured"``)."""


@dataclass
class TrajectoryCheck:
    trajectory: str
    memories: list[str] = field(default_factory=list)
    cases: list[Case] = field(default_factory=list)
    requests: int = 0
    evaluated_requests: int = 0


# -- case extraction (pure) ------------------------------------------------------------


def flatten_values(obj: Any, min_len: int = 3) -> list[str]:
    """String and number leaves of a JSON value (dict keys excluded), as text."""
    out: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, bool) or x is None:
            return
        elif isinstance(x, (int, float)):
            text = str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)
            if len(text) >= min_len:
                out.append(text)
        elif isinstance(x, str) and len(x.strip()) >= min_len:
            out.append(x.strip())

    walk(obj)
    return list(dict.fromkeys(out))


def task_values(trajectory: dict, min_len: int = 3) -> list[str]:
    return flatten_values([a.get("kwargs", {}) for a in trajectory.get("ground_truth_actions") or []], min_len)


def call_values(message: dict, min_len: int = 3) -> list[str]:
    """Argument values of a message's tool calls."""
    args = []
    for call in message.get("tool_calls") or []:
        raw = call.get("function", {}).get("arguments")
        try:
            args.append(json.loads(raw) if isinstance(raw, str) else raw)
        except json.JSONDecodeError:
            continue
    return flatten_values(args, min_len)


def memory_text(blocks, cfg: CheckConfig) -> str:
    return cap_head_and_tail(serialize_messages([m for b in blocks for m in b.messages]), cfg.memory_chars)


def check_trajectory(trajectory: dict, cfg: CheckConfig = CheckConfig()) -> TrajectoryCheck:
    """Replay archiving along one trajectory and extract its (t, value) cases."""
    messages = trajectory["messages"]
    out = TrajectoryCheck(trajectory=str(trajectory.get("id", "?")))
    gt = task_values(trajectory, cfg.min_value_len)
    archived = 0  # old blocks already in memories (always a prefix of the blocks)
    previous_request = None
    for i, history in agent_requests(messages):
        out.requests += 1
        conversation = split_conversation(history)
        blocks = conversation.blocks
        cut = max(0, len(blocks) - cfg.retained)
        old, recent = blocks[:cut], blocks[cut:]
        if len(old) - archived >= cfg.group:
            out.memories.append(memory_text(old[archived:], cfg))
            archived = len(old)
        prefix = list(conversation.prefix)
        sent_before, previous_request = previous_request, prefix + [m for b in blocks[archived:] for m in b.messages]
        if len(out.memories) < cfg.min_memories:
            continue
        out.evaluated_requests += 1
        recent_messages = [m for b in recent for m in b.messages]
        context = serialize_messages(prefix + recent_messages)
        if cfg.exclude_old:
            context += "\n" + serialize_messages([m for b in old[archived:] for m in b.messages])
        next_message = messages[i]
        next_text = serialize_messages([next_message])
        candidates: dict[str, str] = {v: "next" for v in call_values(next_message, cfg.min_value_len)}
        for v in gt:
            candidates.setdefault(v, "next" if v in next_text else "task")
        query = serialize_messages(prefix[-1:] + recent_messages)[-cfg.query_chars :]
        for value, origin in candidates.items():
            if value in context:
                continue
            relevant = tuple(k for k, text in enumerate(out.memories) if value in text)
            if relevant:
                out.cases.append(
                    Case(out.trajectory, i, value, origin, len(out.memories), relevant, query, sent_before)
                )
    return out


# -- ranking and metrics ---------------------------------------------------------------


def rank_memories(query: np.ndarray, memories: np.ndarray) -> list[int]:
    """Memory ids by cosine descending, ties to the lower id (cosine_top_k's order);
    zero vectors last."""
    q = np.asarray(query, dtype=np.float64)
    m = np.asarray(memories, dtype=np.float64)
    qn = np.linalg.norm(q)
    mn = np.linalg.norm(m, axis=1)
    scores = np.where((mn > 0) & (qn > 0), (m @ q) / np.maximum(mn * qn, 1e-300), -np.inf)
    return sorted(range(len(scores)), key=lambda k: (-scores[k], k))


def first_relevant_rank(order: Sequence[int], relevant: Sequence[int]) -> int:
    wanted = set(relevant)
    return next(pos for pos, k in enumerate(order, 1) if k in wanted)


def random_expectations(n: int, r: int, k: int = 3) -> tuple[float, float, float]:
    """Exact (hit@1, hit@k, MRR) of a uniformly random ranking of n memories, r relevant."""
    k = min(k, n)
    hit1 = r / n
    hitk = 1.0 - math.comb(n - r, k) / math.comb(n, k)
    total = math.comb(n, r)
    mrr = sum(math.comb(n - j, r - 1) / total / j for j in range(1, n - r + 2))
    return hit1, hitk, mrr


@dataclass
class MethodResult:
    name: str
    ranks: list[float]  # first relevant rank per case (nan for expectation rows)
    hit1: np.ndarray
    hit3: np.ndarray
    rr: np.ndarray


def score_method(name: str, cases: list[Case], order_of) -> MethodResult:
    hit1, hit3, rr = [], [], []
    ranks: list[float] = []
    for case in cases:
        rank = first_relevant_rank(order_of(case), case.relevant)
        ranks.append(rank)
        hit1.append(rank == 1)
        hit3.append(rank <= 3)
        rr.append(1.0 / rank)
    return MethodResult(name, ranks, np.array(hit1, float), np.array(hit3, float), np.array(rr, float))


def random_method(cases: list[Case]) -> MethodResult:
    rows = [random_expectations(c.n_memories, len(c.relevant)) for c in cases]
    arr = np.array(rows, float).reshape(-1, 3)
    return MethodResult("random (exact expectation)", [math.nan] * len(cases), arr[:, 0], arr[:, 1], arr[:, 2])


def bootstrap_ci(
    values: np.ndarray, groups: np.ndarray, n_boot: int = 2000, seed: int = 0, weights: np.ndarray | None = None
) -> tuple[float, float]:
    """95% interval of the mean (with ``weights``: of sum(values) / sum(weights)),
    resampling whole groups (trajectories)."""
    if len(values) == 0:
        return math.nan, math.nan
    labels = np.unique(groups)
    index = [np.flatnonzero(groups == g) for g in labels]
    sums = np.array([values[ix].sum() for ix in index])
    counts = np.array([len(ix) if weights is None else weights[ix].sum() for ix in index])
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(labels), size=(n_boot, len(labels)))
    totals = counts[picks].sum(1)
    means = sums[picks].sum(1) / np.where(totals > 0, totals, np.nan)  # a draw that weighs nothing: no mean
    if np.isnan(means).all():
        return math.nan, math.nan
    return float(np.nanpercentile(means, 2.5)), float(np.nanpercentile(means, 97.5))


def captured_query_vectors(runner: Any, cases: list[Case]) -> dict[int, np.ndarray]:
    """Per case (by ``id``): the served state at the end of the previous
    request's prompt, rendered as the server renders it (chat template with
    the generation prompt, tool calls as text where the template has no
    tools): what ``query_source="captured"`` recalls with. Cases without a
    previous request are absent (the server falls back to the text query).
    ``runner``: a ``tokenizer`` and ``embed_batch(texts)`` (the benchmark's
    served-state embedder)."""
    tokenizer = runner.tokenizer
    as_text = not template_supports_tools(getattr(tokenizer, "chat_template", None))
    prompts: dict[str, int] = {}
    of_case: dict[int, int] = {}
    for case in cases:
        if case.previous_request is None:
            continue
        messages = render_tools_as_text(case.previous_request) if as_text else case.previous_request
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        of_case[id(case)] = prompts.setdefault(text, len(prompts))
    vectors = runner.embed_batch(list(prompts)) if prompts else np.zeros((0, 1), np.float32)
    return {key: vectors[row] for key, row in of_case.items()}
