"""Replay recorded trajectories against a running vllm-pamer server.

For each policy in turn: every trajectory is one session (``<policy>-<uuid>``),
its steps are sent in order (the recorded history up to each step, greedy,
``max_tokens`` small), up to ``concurrency`` sessions at a time. Each request
asks the server to echo what it sent (``X-Pamer-Echo: 1``), so the evidence
that survived the rewrite is measured on the real context. Around each policy
run the client reads ``/metrics`` (counter deltas) and samples the KV-cache
usage every ``kv_interval_s`` for its peak.

Policies run one after another on the same server: the prefix cache the
first run leaves behind can serve the next one, so compare prefill figures
with that in mind (or restart the server between policies).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from vllm_pamer.core.blocks import Message
from vllm_pamer.replay import prometheus, wire
from vllm_pamer.replay.evidence import (
    Kind,
    available_count,
    context_chars,
    evidence_messages,
    needed_values,
    needs,
    readings,
    trajectory_kind,
)
from vllm_pamer.replay.likelihood import Scored, action_likelihood
from vllm_pamer.replay.records import RunSummary, StepRecord
from vllm_pamer.replay.spending import inserted_spending
from vllm_pamer.salient import action_values
from vllm_pamer.trajectories import agent_requests, trajectory_key

# vLLM: "The decoder prompt (length N) is longer than the maximum model length of M";
# OpenAI-style servers: "maximum context length".
CONTEXT_ERROR_RE = re.compile(r"context length|maximum model length|max_model_len", re.IGNORECASE)
# Templates without tool support see calls written as text (core/render.py); a
# model imitating its history answers the same way.
TOOL_CALL_TEXT_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class ReplayStep(msgspec.Struct, frozen=True):
    step: int
    message_index: int
    history: list[Message]
    needed: list[str]
    chars_original: int
    needs: list[str] = []
    """By the one rule (``evidence.needs``)."""
    action: dict[str, Any] = msgspec.field(default_factory=dict)
    """The recorded next action (``messages[message_index]``), for its likelihood."""


class TrajectoryPlan(msgspec.Struct, frozen=True):
    trajectory_id: str
    kind: Kind
    tools: list[dict[str, Any]] | None
    steps: list[ReplayStep]
    key: str = ""
    """``trajectories.trajectory_key``: unique where ids repeat."""


def plan_replay(trajectories: Iterable[Mapping[str, Any]], max_steps: int | None = None) -> list[TrajectoryPlan]:
    """The requests to send (the first ``max_steps`` of each trajectory), with
    the evidence each step's recorded action needs (pure; computed once for all
    policies)."""
    plans: list[TrajectoryPlan] = []
    for trajectory in trajectories:
        kind = trajectory_kind(trajectory)
        messages = trajectory["messages"]
        steps = []
        for step, (i, history) in enumerate(agent_requests(messages)):
            if max_steps is not None and step >= max_steps:
                break
            needed = sorted(needed_values(history, messages[i], kind))
            wanted = sorted(needs(history, messages[i], kind))
            steps.append(ReplayStep(step, i, list(history), needed, context_chars(history), wanted, dict(messages[i])))
        plans.append(
            TrajectoryPlan(
                str(trajectory.get("id", len(plans))), kind, trajectory.get("tools"), steps, trajectory_key(trajectory)
            )
        )
    return plans


@dataclass(frozen=True)
class ReplaySettings:
    url: str = "http://127.0.0.1:8000"
    max_tokens: int = 64
    concurrency: int = 1
    timeout_s: float = 600.0
    model: str | None = None
    """Served model name (default: the first of ``GET /v1/models``)."""
    kv_interval_s: float = 0.5
    progress: bool = True
    reset_prefix_cache: bool = False
    """Empty vLLM's prefix cache before each policy (``POST /reset_prefix_cache``,
    served when the server runs with ``VLLM_SERVER_DEV_MODE=1``), so no policy
    reuses the prefixes an earlier one computed: prefill figures compare."""
    context_budget: Mapping[str, int] | None = None
    """Per trajectory kind (``tau``, ``swe``), the context budget every request
    of that kind sets (``X-Pamer-Context-Budget``), so every policy with a
    budget runs at the same one; None: each policy's own."""
    api: wire.Api = "chat"
    """The API the steps are sent through (``wire.py``)."""
    tool_s: float = 0.0
    """Seconds a session waits between an answer and its next request (the
    agent's tools running), in which a memory written ahead can be written."""
    stream: bool = False
    """Stream each answer (chat completions) and record its time to first
    token (``StepRecord.ttft_s``): the time the agent waits before anything
    comes back, a compaction's wait included."""
    likelihood: bool = False
    """After a policy's run (its metrics already read), score each answered
    request's recorded next action given what the policy sent
    (``action_likelihood``): a full prefill per request, since vLLM reads no
    prefix cache for prompt log-probabilities."""


def parse_budgets(text: str) -> dict[str, int]:
    """``tau=3000,swe=4096`` -> ``{"tau": 3000, "swe": 4096}`` (the
    ``--context-budget`` flag); raises ValueError for another kind or a bad number."""
    budgets: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        kind, _, tokens = item.partition("=")
        if kind not in ("tau", "swe") or not tokens.isdigit() or int(tokens) <= 0:
            raise ValueError(f"--context-budget takes KIND=TOKENS for tau and swe, not {item!r}")
        budgets[kind] = int(tokens)
    return budgets


def model_action(message: Mapping[str, Any]) -> tuple[str | None, str | None, str, list[str]]:
    """(tool name, arguments, text, salient values) of the model's answer: its
    first tool call, else a ``<tool_call>{...}</tool_call>`` written in its text."""
    text = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if not calls:
        match = TOOL_CALL_TEXT_RE.search(text)
        try:
            parsed = json.loads(match.group(1)) if match else None
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
            arguments = parsed.get("arguments")
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
            calls = [{"function": {"name": parsed["name"], "arguments": arguments}}]
    prose = TOOL_CALL_TEXT_RE.sub(" ", text).replace("<tool_call>", " ")  # the markup is not a value
    values = sorted(action_values({"content": prose, "tool_calls": calls}))
    if not calls:
        return None, None, text, values
    function = calls[0].get("function") or {}
    return function.get("name"), function.get("arguments"), text, values


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """All samples of ``/metrics``; empty when the server has none."""
    try:
        response = await client.get(url.rstrip("/") + "/metrics", timeout=30)
        response.raise_for_status()
    except httpx.HTTPError:
        return {}
    return prometheus.parse_samples(response.text)


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    response = await client.get(url.rstrip("/") + "/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _peak_kv(client: httpx.AsyncClient, url: str, interval_s: float, stop: asyncio.Event) -> float | None:
    """Sample the KV-cache usage until ``stop``; the highest value seen."""
    peak: float | None = None
    while not stop.is_set():
        usage = prometheus.kv_usage(await scrape(client, url))
        if usage is not None:
            peak = usage if peak is None else max(peak, usage)
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass
    return peak


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:2000]


async def _streamed(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout_s: float,
    started: float,
    record: StepRecord,
) -> tuple[httpx.Response, dict[str, Any]]:
    """A streamed chat request: the response (its body read) and the answer
    folded back into a plain body; the first token's time goes to ``record``."""
    answer = wire.StreamedChat()
    async with client.stream("POST", url, json=wire.streamed(body), headers=headers, timeout=timeout_s) as response:
        if response.status_code != 200:
            await response.aread()
            return response, {}
        async for line in response.aiter_lines():
            if answer.add(line):
                record.ttft_s = time.perf_counter() - started
    return response, answer.body()


def _unanswered(record: StepRecord, error: str, refused: bool) -> StepRecord:
    """No answer: ``beyond_window`` when refused (a 400, a streamed error) for its length, else ``error``."""
    record.error = error
    record.status = "beyond_window" if refused and CONTEXT_ERROR_RE.search(error) else "error"
    return record


async def send_step(
    client: httpx.AsyncClient,
    settings: ReplaySettings,
    model: str,
    policy: str,
    session_id: str,
    plan: TrajectoryPlan,
    step: ReplayStep,
    keep: list[Scored] | None = None,
) -> StepRecord:
    """One request; errors become records (a prompt over the window is
    ``beyond_window``). ``keep``: where an answered request is kept for the
    likelihood pass."""
    body = wire.request_body(settings.api, model, step.history, plan.tools, settings.max_tokens)
    if keep is not None and settings.api == "chat":  # (the likelihood pass speaks chat completions)
        body["return_token_ids"] = True  # the likelihood pass checks its prompt starts with these
    headers = {"X-Session-ID": session_id, "X-Pamer-Policy": policy, "X-Pamer-Echo": "1"}
    if settings.context_budget and plan.kind in settings.context_budget:
        headers["X-Pamer-Context-Budget"] = str(settings.context_budget[plan.kind])
    record = StepRecord(
        policy=policy,
        trajectory_id=plan.trajectory_id,
        trajectory_key=plan.key,
        kind=plan.kind,
        session_id=session_id,
        step=step.step,
        message_index=step.message_index,
        status="ok",
        latency_s=0.0,
        needed=len(step.needed),
        needs=len(step.needs),
        chars_original=step.chars_original,
    )
    url = settings.url.rstrip("/") + wire.ROUTES[settings.api]
    started = time.perf_counter()
    try:
        if settings.stream:
            response, data = await _streamed(client, url, body, headers, settings.timeout_s, started, record)
        else:
            response = await client.post(url, json=body, headers=headers, timeout=settings.timeout_s)
            data = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: not JSON, or a stream that ended in an error
        record.latency_s = time.perf_counter() - started
        return _unanswered(record, f"{type(exc).__name__}: {exc}", isinstance(exc, ValueError))
    record.latency_s = time.perf_counter() - started
    if response.status_code != 200:
        return _unanswered(record, _error_message(response), response.status_code == 400)

    pamer = dict(data.get("pamer") or {})
    sent = pamer.pop("messages_sent", None)
    record.pamer = pamer
    record.prompt_tokens_in = pamer.get("prompt_tokens_in")
    record.prompt_tokens_out = pamer.get("prompt_tokens_out")
    record.usage_prompt_tokens, record.usage_completion_tokens, record.cached_tokens = wire.usage_of(settings.api, data)
    message = wire.answer_message(settings.api, data)
    record.action_tool, record.action_arguments, record.action_text, record.action_values = model_action(message)
    if sent is not None:
        record.available = available_count(step.needed, evidence_messages(sent, step.history, plan.kind))
        record.availability = record.available / record.needed if record.needed else None
        record.readable, record.observed = readings(step.needs, sent, step.history)
        record.chars_sent = context_chars(sent)
        record.inserted = inserted_spending(sent, step.history)
        record.chars_share = record.chars_sent / step.chars_original if step.chars_original else None
        prompt_ids = data.get("prompt_token_ids")
        if keep is not None and isinstance(prompt_ids, list) and step.action:
            keep.append(Scored(record, plan.tools, step.action, sent, prompt_ids))
    return record


async def replay_policy(
    client: httpx.AsyncClient, settings: ReplaySettings, model: str, policy: str, plans: Sequence[TrajectoryPlan]
) -> tuple[list[StepRecord], RunSummary]:
    """All trajectories under one policy, ``settings.concurrency`` sessions at a time."""
    from tqdm import tqdm

    gate = asyncio.Semaphore(max(1, settings.concurrency))
    records: list[StepRecord] = []
    bar = tqdm(
        total=sum(len(p.steps) for p in plans), desc=f"replay {policy}", unit="req", disable=not settings.progress
    )

    kept: list[Scored] | None = [] if settings.likelihood else None

    async def run_session(plan: TrajectoryPlan) -> None:
        session_id = f"{policy}-{uuid.uuid4().hex[:12]}"
        async with gate:
            for i, step in enumerate(plan.steps):  # an agent waits for each answer before its next request
                if i and settings.tool_s:
                    await asyncio.sleep(settings.tool_s)  # its tools run
                records.append(await send_step(client, settings, model, policy, session_id, plan, step, kept))
                bar.update(1)

    if settings.reset_prefix_cache:
        response = await client.post(f"{settings.url}/reset_prefix_cache")
        if response.status_code != 200:
            raise RuntimeError(
                f"prefix cache reset refused ({response.status_code}): start the server "
                "with VLLM_SERVER_DEV_MODE=1 or replay without the reset"
            )
    before = await scrape(client, settings.url)
    stop = asyncio.Event()
    sampler = asyncio.create_task(_peak_kv(client, settings.url, settings.kv_interval_s, stop))
    started = time.perf_counter()
    try:
        await asyncio.gather(*(run_session(plan) for plan in plans))
    finally:
        elapsed = time.perf_counter() - started
        stop.set()
        peak = await sampler
        bar.close()
    after = await scrape(client, settings.url)
    records.sort(key=lambda r: (r.trajectory_key, r.step))
    kinds = {plan.kind for plan in plans}
    summary = RunSummary(
        policy=policy,
        kind=kinds.pop() if len(kinds) == 1 else "",
        trajectories=len(plans),
        requests=len(records),
        elapsed_s=elapsed,
        metric_deltas=prometheus.deltas(prometheus.counters(before), prometheus.counters(after)),
        kv_usage_peak=peak,
    )
    if kept:  # after the run's metrics: these requests are no part of the policy's cost
        scoring = tqdm(total=len(kept), desc=f"likelihood {policy}", unit="req", disable=not settings.progress)

        async def score(item: Scored) -> None:
            async with gate:
                found = await action_likelihood(client, settings.url, settings.timeout_s, model, item)
            if found is not None:
                item.record.action_logprob, item.record.action_tokens = found
            scoring.update(1)

        await asyncio.gather(*(score(item) for item in kept))
        scoring.close()
    return records, summary


@asynccontextmanager
async def connect(settings: ReplaySettings) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """An HTTP client sized for the replay's sessions (plus the metrics
    scrapes) and the model to ask for: ``settings.model`` or the served one."""
    limits = httpx.Limits(max_connections=max(1, settings.concurrency) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        yield client, settings.model or await served_model(client, settings.url)


async def replay(
    settings: ReplaySettings, policies: Sequence[str], plans: Sequence[TrajectoryPlan]
) -> tuple[list[StepRecord], list[RunSummary]]:
    """Every policy in turn over the same plans."""
    async with connect(settings) as (client, model):
        records: list[StepRecord] = []
        runs: list[RunSummary] = []
        for policy in policies:
            policy_records, summary = await replay_policy(client, settings, model, policy, plans)
            records += policy_records
            runs.append(summary)
    return records, runs


def run_replay(
    settings: ReplaySettings, policies: Sequence[str], plans: Sequence[TrajectoryPlan]
) -> tuple[list[StepRecord], list[RunSummary]]:
    """Synchronous entry point (the CLI and tests)."""
    return asyncio.run(replay(settings, policies, plans))
