"""The replay client (``replay/client.py``) against an in-process fake server
(httpx.MockTransport): no engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest

from tests.support.replay import SWE
from vllm_pamer.replay.client import (
    ReplaySettings,
    model_action,
    parse_budgets,
    plan_replay,
    replay_policy,
    served_model,
)
from vllm_pamer.replay.evidence import context_chars, recent_k_context

WINDOW_MESSAGES = 7  # the fake server refuses longer requests (the last step has 8 messages)


class FakeServer:
    """Answers like vllm-pamer serve: recent_k keeps the prefix and the last block."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.seen: list[tuple[str, int]] = []  # (session, messages) in arrival order

    def metrics(self) -> str:
        return (
            f'vllm:prompt_tokens_total{{engine="0"}} {self.prompt_tokens}\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} {min(1.0, self.prompt_tokens / 1000)}\n'
            f'vllm_pamer_internal_prompt_tokens_total{{kind="summary"}} 7\n'
        )

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=self.metrics())
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        messages, policy = body["messages"], request.headers["x-pamer-policy"]
        assert request.headers["x-pamer-echo"] == "1" and body["temperature"] == 0 and body["max_tokens"] == 8
        self.seen.append((request.headers["x-session-id"], len(messages)))
        await asyncio.sleep(0.001)  # let other sessions interleave
        if len(messages) > WINDOW_MESSAGES:
            error = {"message": "The decoder prompt (length 9000) is longer than the maximum model length of 8192."}
            if body.get("stream"):  # the error after the first byte, as a last chunk
                return httpx.Response(200, text=f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n")
            return httpx.Response(400, json={"error": {**error, "type": "BadRequestError", "code": 400}})
        sent = recent_k_context(messages, 1) if policy == "recent_k" else messages
        tokens_in, tokens_out = context_chars(messages) // 4, context_chars(sent) // 4
        self.prompt_tokens += tokens_out
        pamer = {
            "policy": policy,
            "action": "rewritten" if sent != messages else "none",
            "prompt_tokens_in": tokens_in,
            "prompt_tokens_out": tokens_out,
            "messages_sent": sent,
        }
        call = {"name": "bash", "arguments": json.dumps({"command": "cat pkg/alpha_module.py"})}
        message = {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"}
        usage = {"prompt_tokens": tokens_out, "completion_tokens": 8}
        if body.get("stream"):  # the text in two deltas, then the usage, the report and [DONE]
            assert body["stream_options"] == {"include_usage": True}
            text = message["content"]
            chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]}]
            chunks += [{"choices": [{"delta": {"content": part}}]} for part in (text[:5], text[5:])]
            chunks += [{"choices": [], "usage": usage}, {"choices": [], "pamer": pamer}]
            lines = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
            return httpx.Response(200, text=lines + "data: [DONE]\n\n")
        return httpx.Response(200, json={"choices": [{"message": message}], "usage": usage, "pamer": pamer})


def run(policy: str, trajectories, concurrency: int = 1, tool_s: float = 0.0, stream: bool = False):
    server = FakeServer()
    settings = ReplaySettings(
        url="http://fake",
        max_tokens=8,
        concurrency=concurrency,
        kv_interval_s=0.01,
        progress=False,
        tool_s=tool_s,
        stream=stream,
    )

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server.handle)) as client:
            model = await served_model(client, settings.url)
            return await replay_policy(client, settings, model, policy, plan_replay(trajectories))

    records, summary = asyncio.run(go())
    return server, records, summary


def test_replay_records_each_step():
    _server, records, summary = run("recent_k", [SWE])
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert {r.session_id for r in records} == {records[0].session_id}
    assert records[0].session_id.startswith("recent_k-")
    ok, beyond = records[:3], records[3]
    assert [r.status for r in ok] == ["ok"] * 3
    assert beyond.status == "beyond_window" and "maximum model length" in beyond.error
    assert beyond.prompt_tokens_out is None and beyond.availability is None
    for r in ok:
        assert "messages_sent" not in r.pamer and r.prompt_tokens_out == r.usage_prompt_tokens
        assert r.action_tool == "bash" and "pkg/alpha_module.py" in r.action_values
    # step 2 needs compute_total (B1's output, kept) and pkg/beta_module.py (B0's, dropped)
    assert (ok[2].needed, ok[2].available, ok[2].availability) == (2, 1, 0.5)
    assert ok[1].availability == 1.0 and ok[0].availability is None  # step 0 needs nothing
    assert ok[2].chars_share == pytest.approx(ok[2].chars_sent / ok[2].chars_original) and ok[2].chars_share < 1
    assert summary.requests == 4 and summary.trajectories == 1
    assert summary.metric_deltas["vllm:prompt_tokens_total"] == sum(r.prompt_tokens_out for r in ok)
    assert summary.metric_deltas['vllm_pamer_internal_prompt_tokens_total{kind="summary"}'] == 0
    assert summary.kv_usage_peak is not None


def test_sessions_run_concurrently_but_steps_in_order():
    trajectories = [{**SWE, "id": f"t{n}"} for n in range(3)]
    server, records, _ = run("none", trajectories, concurrency=3)
    sessions = {r.session_id for r in records}
    assert len(sessions) == 3 and all(s.startswith("none-") for s in sessions)
    for session in sessions:  # each session's requests arrive in step order
        lengths = [n for s, n in server.seen if s == session]
        assert lengths == sorted(lengths) and len(lengths) == 4
    first_three = {s for s, _ in server.seen[:3]}
    assert len(first_three) == 3  # all three sessions were in flight at once
    assert all(r.chars_share == 1.0 for r in records if r.status == "ok")


def test_a_session_waits_its_tool_time_between_steps():
    _, records, summary = run("none", [SWE], tool_s=0.2)
    assert len(records) == 4 and summary.elapsed_s >= 3 * 0.2  # between its 4 steps, not before the first
    assert all(r.latency_s < 0.2 for r in records)  # the tool time is no request's latency


def test_model_action():
    call = {"id": "c", "type": "function", "function": {"name": "get_user", "arguments": '{"user_id": "mia_li_3668"}'}}
    assert model_action({"content": None, "tool_calls": [call]}) == (
        "get_user",
        '{"user_id": "mia_li_3668"}',
        "",
        ["mia_li_3668"],
    )
    text = 'Sure. <tool_call>{"name": "cancel", "arguments": {"reservation_id": "HAT136"}}</tool_call>'
    tool, arguments, _, values = model_action({"content": text})
    assert tool == "cancel" and json.loads(arguments) == {"reservation_id": "HAT136"} and values == ["HAT136"]
    assert model_action({"content": "Your booking YAX4DR is confirmed."}) == (
        None,
        None,
        "Your booking YAX4DR is confirmed.",
        ["YAX4DR"],
    )
    assert model_action({"content": "<tool_call>{not json</tool_call>"})[0] is None


def test_a_context_budget_per_kind_rides_on_every_request_of_that_kind():
    seen = []

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            seen.append(request.headers.get("x-pamer-context-budget"))
        return await FakeServer().handle(request)

    settings = ReplaySettings(url="http://fake", max_tokens=8, kv_interval_s=0.01, progress=False)
    for budgets, want in (({"swe": 4096}, "4096"), ({"tau": 3000}, None), (None, None)):
        seen.clear()

        async def go(budgets=budgets):
            async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
                chosen = dataclasses.replace(settings, context_budget=budgets)
                return await replay_policy(client, chosen, "fake-model", "none", plan_replay([SWE]))

        asyncio.run(go())
        assert seen and set(seen) == {want}, (budgets, seen)
    assert parse_budgets("tau=3000, swe=4096") == {"tau": 3000, "swe": 4096}
    for bad in ("tau=0", "web=10", "swe:4096", "swe=x"):
        with pytest.raises(ValueError, match="KIND=TOKENS"):
            parse_budgets(bad)


def test_a_streamed_replay_records_what_a_plain_one_does_and_the_first_token():
    """The answer folded back from its chunks reads as the plain answer; a
    stream that ends in a context-length error is beyond the window."""
    _, plain, _ = run("recent_k", [SWE])
    _, streamed, _ = run("recent_k", [SWE], stream=True)
    fields = ("status", "action_tool", "action_values", "available", "chars_sent", "usage_prompt_tokens", "readable")
    for a, b in zip(plain, streamed, strict=True):
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    assert all(r.ttft_s is not None and r.ttft_s <= r.latency_s for r in streamed[:3])
    assert plain[0].ttft_s is None and streamed[3].ttft_s is None
    assert streamed[3].status == "beyond_window" and "maximum model length" in streamed[3].error
