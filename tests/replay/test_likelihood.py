"""The next-action likelihood of the replay (replay/likelihood.py's
``action_likelihood``, run by replay/client.py after a policy's run;
replay/readings.py's ``add_likelihood``) against an in-process fake server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from vllm_pamer.replay.client import ReplaySettings, plan_replay, replay_policy
from vllm_pamer.replay.readings import add_likelihood
from vllm_pamer.replay.records import RunSummary, StepRecord
from vllm_pamer.replay.report import summarize

SWE = {
    "id": "toy",
    "source": "mini-swe-agent/toy",
    "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix it."},
        {"role": "assistant", "content": "look"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "done"},
    ],
}


class Server:
    """Prompt tokens: one per message (its index + 1); the teacher-forced
    request's last message (the action) is two tokens, -1 and -3 nats."""

    def __init__(self, broken_prefix: bool = False) -> None:
        self.broken_prefix = broken_prefix
        self.scored: list[dict] = []
        self.metrics_reads = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            self.metrics_reads += 1
            return httpx.Response(200, text="")
        body = json.loads(request.content)
        ids = list(range(1, len(body["messages"]) + 1))
        if body.get("prompt_logprobs") is None:  # the policy's request
            pamer = {"action": "none", "messages_sent": body["messages"]}
            answer = {"choices": [{"message": {"role": "assistant", "content": "x"}}], "pamer": pamer}
            return httpx.Response(200, json={**answer, "prompt_token_ids": ids})
        self.scored.append(body)
        assert body["add_generation_prompt"] is False and "continue_final_message" not in body  # a closed turn
        assert "x-session-id" not in request.headers  # no session's state changes
        prompt = ids[:-1] + [100, 101]
        if self.broken_prefix:
            prompt[0] = 99
        logprobs = [None] * (len(prompt) - 2) + [{"100": {"logprob": -1.0}}, {"101": {"logprob": -3.0}}]
        return httpx.Response(200, json={"choices": [], "prompt_token_ids": prompt, "prompt_logprobs": logprobs})


def _run(server: Server, likelihood: bool = True):
    settings = ReplaySettings(
        url="http://fake", max_tokens=8, kv_interval_s=0.01, progress=False, likelihood=likelihood
    )

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server.handle)) as client:
            return await replay_policy(client, settings, "m", "none", plan_replay([SWE]))

    return asyncio.run(go())


def test_the_action_is_scored_after_the_policys_prompt_and_after_its_metrics():
    server = Server()
    records, _ = _run(server)
    assert [(r.action_logprob, r.action_tokens) for r in records] == [(-2.0, 2), (-2.0, 2)]
    assert [s["messages"][-1]["content"] for s in server.scored] == ["look", "done"]  # the recorded actions
    assert server.metrics_reads >= 2  # before and after the run; the scoring comes after both


def test_a_prompt_that_does_not_start_with_the_policys_is_not_scored():
    records, _ = _run(Server(broken_prefix=True))
    assert [r.action_logprob for r in records] == [None, None]
    server = Server()
    _run(server, likelihood=False)
    assert server.scored == []


def _rec(policy, step, logprob, share):
    return StepRecord(
        policy=policy,
        trajectory_id="t",
        session_id="s",
        step=step,
        message_index=2,
        status="ok",
        latency_s=1.0,
        action_logprob=logprob,
        chars_sent=int(100 * share),
        chars_original=100,
    )


def test_what_a_policy_loses_is_read_against_none_and_recency_at_its_share():
    records = (
        [_rec("none", s, -1.0, 1.0) for s in range(2)]
        + [_rec("recent_k", s, -3.0, 0.2) for s in range(2)]  # loses 2.0 at 20% of the characters
        + [_rec("recent_10", s, -2.0, 0.6) for s in range(2)]  # loses 1.0 at 60%
        + [_rec("pamer", 0, -1.5, 0.4), _rec("pamer", 1, None, 0.4)]
    )
    runs = [
        RunSummary(policy=p, trajectories=1, requests=2, elapsed_s=1.0)
        for p in ("none", "recent_k", "recent_10", "pamer")
    ]
    rows = {row.policy: row for row in summarize(records, runs)}
    add_likelihood(list(rows.values()), records)
    pamer = rows["pamer"]
    assert pamer.action_logprob == -1.5 and pamer.logprob_lost == pytest.approx(0.5)  # the scored request only
    assert pamer.logprob_lost_recency == pytest.approx(1.5)  # halfway between recency's 2.0 and 1.0
    assert rows["none"].logprob_lost == 0.0
    assert pamer.scored == 1 and rows["none"].scored == 2


def test_past_the_largest_recency_row_recency_is_read_towards_the_full_history():
    """Above the last recency row the curve runs to ``none`` (every block,
    nothing lost); below the first there is nothing to compare."""
    records = (
        [_rec("none", s, -1.0, 1.0) for s in range(2)]
        + [_rec("recent_k", s, -3.0, 0.2) for s in range(2)]  # loses 2.0 at 20%
        + [_rec("pamer", s, -1.2, 0.6) for s in range(2)]
        + [_rec("truncate", s, -4.0, 0.1) for s in range(2)]
    )
    runs = [
        RunSummary(policy=p, trajectories=1, requests=2, elapsed_s=1.0)
        for p in ("none", "recent_k", "pamer", "truncate")
    ]
    rows = {row.policy: row for row in summarize(records, runs)}
    add_likelihood(list(rows.values()), records)
    assert rows["pamer"].logprob_lost_recency == pytest.approx(1.0)  # halfway from 2.0 at 20% to 0 at 100%
    assert rows["none"].logprob_lost_recency == 0.0
    assert rows["truncate"].logprob_lost_recency is None  # below recent_k's share
