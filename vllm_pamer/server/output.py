"""Output processing of the plugin's routes: the ``pamer`` report on every
response (in the body, on a streamed chunk or event, and as ``X-Pamer-*``
headers), and OpenAI-style errors."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_pamer.channel import CaptureRecord
from vllm_pamer.server import metrics

ERROR_TYPES = {
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    503: "ServiceUnavailableError",
}
"""The error ``type`` by status, as OpenAI's clients name them (else ``BadRequestError``)."""


def error_response(status: int, message: str, err_type: str | None = None) -> JSONResponse:
    err_type = err_type or ERROR_TYPES.get(status, "BadRequestError")
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": err_type, "param": None, "code": status}},
    )


class PamerReport(msgspec.Struct):
    """The ``pamer`` object of every chat completion response."""

    session_id: str | None
    policy: str
    action: str
    captured: bool = False
    head_logits: list[float] | None = None
    votes: int | None = None
    compress_vote: bool | None = None
    prompt_tokens_in: int | None = None
    prompt_tokens_out: int | None = None
    detail: str = ""
    recalled: list[int] | None = None
    """Ids of the memories shown, in order (None: this request recalled nothing)."""
    schedule: dict[str, Any] | None = None
    """What the compaction schedule saw and did: budget, band, sent tokens,
    trigger, cache-break tokens, KV usage (None: the policy has no schedule)."""
    api_process: int = msgspec.field(default_factory=os.getpid)
    """The id of the API-server process that served the request (vLLM runs
    several under ``--api-server-count``)."""
    api: str = "chat"
    """The API the request came through (``server/apis.py``)."""
    messages_sent: list[dict[str, Any]] | None = None
    """The rewritten messages, only when asked for (``X-Pamer-Echo: 1`` or
    ``"pamer_echo": true``): what the policy sent, before tools-as-text rendering."""

    def note(self, text: str) -> None:
        self.detail = f"{self.detail}; {text}" if self.detail else text

    def add_capture(self, record: CaptureRecord | None) -> None:
        self.captured = record is not None
        if record is not None and self.prompt_tokens_in is None and self.prompt_tokens_out is None:
            # sent as received, and not counted here: the engine's own count
            self.prompt_tokens_in = self.prompt_tokens_out = record.num_prompt_tokens
        if record is not None:
            self.head_logits = record.head_logits
            self.votes = record.votes
            self.compress_vote = record.compress_vote
            if record.heads_error:
                self.note(f"heads: {record.heads_error}")


async def finish_report(
    report: PamerReport,
    capture_task: asyncio.Task[CaptureRecord | None],
    wait_s: float,
    echo: bool,
) -> dict[str, Any]:
    """The report once the request's capture arrived (or ``wait_s`` passed)."""
    try:
        record = await asyncio.wait_for(asyncio.shield(capture_task), wait_s)
    except asyncio.TimeoutError:
        capture_task.cancel()
        record = None
    report.add_capture(record)
    (metrics.CAPTURES if record is not None else metrics.MISSED_CAPTURES).inc()
    reported = msgspec.to_builtins(report)
    if not echo:
        reported.pop("messages_sent")
    return reported


ReportMaker = Callable[[], Awaitable[dict[str, Any]]]
"""Makes a request's report once its capture arrived (``finish_report``)."""


def report_headers(report: PamerReport) -> dict[str, str]:
    """What the plugin did, as response headers, set before the first byte of
    any managed API's answer, streamed or not (a client that reads no body
    field sees them too)."""
    schedule = report.schedule or {}
    fields = {
        "X-Pamer-Session": report.session_id,
        "X-Pamer-Policy": report.policy,
        "X-Pamer-Action": report.action.split(" ", 1)[0],
        "X-Pamer-Prompt-Tokens-In": report.prompt_tokens_in,
        "X-Pamer-Prompt-Tokens-Out": report.prompt_tokens_out,
        "X-Pamer-Trigger": schedule.get("trigger"),
    }
    return {name: str(value) for name, value in fields.items() if value is not None}


async def with_report(result: Any, report: ReportMaker | None, headers: dict[str, str] | None = None) -> Response:
    """vLLM's chat answer with the report: in the body, or as a last streamed
    chunk (empty ``choices``, with the stream's ``id``, ``created`` and
    ``model``) before ``[DONE]``. ``report()`` makes it, once (None: no report)."""
    if not hasattr(result, "__aiter__"):
        content = result.model_dump()
        if report is not None:
            content["pamer"] = await report()
        return JSONResponse(content=content, headers=headers)

    async def stream() -> AsyncIterator[str]:
        first: dict[str, Any] = {}
        async for chunk in result:
            if chunk.startswith("data: [DONE]") and report is not None:
                final: dict[str, Any] = {
                    "id": first.get("id"),
                    "object": "chat.completion.chunk",
                    "created": first.get("created", int(time.time())),
                    "model": first.get("model", ""),
                    "choices": [],
                    "pamer": await report(),
                }
                yield f"data: {json.dumps(final)}\n\n"
            elif not first and chunk.startswith("data: {"):
                try:
                    first = json.loads(chunk[6:])
                except json.JSONDecodeError:
                    pass
            yield chunk

    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


MESSAGE_DELTA = "event: message_delta\n"


async def with_messages_report(
    result: AsyncIterator[str], report: ReportMaker | None, headers: dict[str, str]
) -> Response:
    """A stream of Anthropic events with the report on its ``message_delta``
    event (the one that carries the usage, before ``message_stop``)."""

    async def stream() -> AsyncIterator[str]:
        async for chunk in result:
            if report is not None and chunk.startswith(MESSAGE_DELTA) and "\ndata: " in chunk:
                head, data = chunk.split("\ndata: ", 1)
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    yield chunk
                    continue
                event["pamer"] = await report()
                chunk = f"{head}\ndata: {json.dumps(event)}\n\n"
            yield chunk

    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)
