"""What the endpoint reports beside the answer (``server/output.py``)."""

from __future__ import annotations

from vllm_pamer.channel import CaptureRecord
from vllm_pamer.server.output import PamerReport


def test_report_takes_the_engines_prompt_count_when_the_policy_counted_none():
    record = CaptureRecord(key="k", request_id="r", session_id=None, num_prompt_tokens=321, hidden=b"")
    uncounted = PamerReport(session_id=None, policy="none", action="none")
    uncounted.add_capture(record)
    assert (uncounted.prompt_tokens_in, uncounted.prompt_tokens_out) == (321, 321)
    counted = PamerReport(session_id=None, policy="pamer", action="rewritten", prompt_tokens_in=900)
    counted.prompt_tokens_out = 300
    counted.add_capture(record)  # the policy's own counts stay
    assert (counted.prompt_tokens_in, counted.prompt_tokens_out) == (900, 300)


def _stream(chunks):
    async def gen():
        for chunk in chunks:
            yield chunk

    return gen()


def _body(response) -> str:
    import asyncio

    async def read():
        return "".join([c if isinstance(c, str) else c.decode() async for c in response.body_iterator])

    return asyncio.run(read())


def _run(coro):
    import asyncio

    return asyncio.run(coro)


async def _made_report():
    return {"action": "recalled", "session_id": "s"}


def test_a_streamed_chat_answer_ends_with_a_chunk_that_carries_the_report():
    import json

    from vllm_pamer.server.output import with_report

    first = {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": []}
    chunks = [f"data: {json.dumps(first)}\n\n", "data: [DONE]\n\n"]
    response = _run(with_report(_stream(chunks), _made_report, {"X-Pamer-Action": "recalled"}))
    assert response.headers["x-pamer-action"] == "recalled"
    events = [line[6:] for line in _body(response).split("\n\n") if line.startswith("data: {")]
    last = json.loads(events[-1])
    assert last["pamer"]["action"] == "recalled" and last["choices"] == []
    assert (last["id"], last["created"], last["model"]) == ("c1", 7, "m")  # the chunk type's required fields


def test_a_streamed_messages_answer_carries_the_report_on_its_message_delta():
    import json

    from vllm_pamer.server.output import with_messages_report

    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}
    chunks = [
        'event: message_start\ndata: {"type": "message_start"}\n\n',
        f"event: message_delta\ndata: {json.dumps(delta)}\n\n",
        'event: message_stop\ndata: {"type": "message_stop"}\n\n',
    ]
    response = _run(with_messages_report(_stream(chunks), _made_report, {}))
    events = [e for e in _body(response).split("\n\n") if e]
    assert len(events) == 3 and events[0] == chunks[0].strip() and events[2] == chunks[2].strip()
    name, data = events[1].split("\ndata: ")
    assert name == "event: message_delta"
    assert json.loads(data) == {**delta, "pamer": {"action": "recalled", "session_id": "s"}}


def test_the_report_goes_in_headers_too():
    from vllm_pamer.server.output import report_headers

    report = PamerReport(session_id="s1", policy="pamer", action="compressed (vote)", prompt_tokens_in=900)
    report.prompt_tokens_out, report.schedule = 400, {"trigger": "vote"}
    assert report_headers(report) == {
        "X-Pamer-Session": "s1",
        "X-Pamer-Policy": "pamer",
        "X-Pamer-Action": "compressed",
        "X-Pamer-Prompt-Tokens-In": "900",
        "X-Pamer-Prompt-Tokens-Out": "400",
        "X-Pamer-Trigger": "vote",
    }
    assert "X-Pamer-Session" not in report_headers(PamerReport(session_id=None, policy="none", action="none"))
