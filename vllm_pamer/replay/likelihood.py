"""The next action's likelihood given what a policy sent (``vllm-pamer
replay --likelihood``): one teacher-forced request per answered request, after
the policy's run, so its cost is no part of the policy's figures. It cannot be
raised by copying strings the agent would not see: it scores the recorded
action under the served model."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from vllm_pamer.core.blocks import Message
from vllm_pamer.replay.records import StepRecord


class Scored(msgspec.Struct):
    """What the likelihood pass needs of an answered request."""

    record: StepRecord
    tools: list[dict[str, Any]] | None
    """The request's tools (they render into the prompt)."""
    action: dict[str, Any]
    """The recorded next action."""
    sent: list[Message]
    """What the policy sent."""
    prompt_ids: list[int]
    """The policy's prompt token ids (the generation prompt included)."""


async def action_likelihood(
    client: httpx.AsyncClient, url: str, timeout_s: float, model: str, scored: Scored
) -> tuple[float, int] | None:
    """The recorded next action's mean log-probability per token given what
    the policy sent, and its token count: teacher forced, the action appended
    as a whole assistant turn (its text, its tool calls as the template
    renders them, its end of turn), its tokens read from vLLM's prompt
    log-probabilities after the policy's own prompt (which must be a prefix of
    this one). Sent with policy ``none`` and no session, so the plugin changes
    nothing and keeps no state. None when it cannot be read."""
    action = {k: v for k, v in scored.action.items() if k in ("role", "content", "tool_calls")}
    body: dict[str, Any] = {
        "model": model,
        "messages": [*scored.sent, action],
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 0,
        "add_generation_prompt": False,
        "return_token_ids": True,
    }
    if scored.tools:
        body["tools"] = scored.tools
    try:
        response = await client.post(
            url.rstrip("/") + "/v1/chat/completions",
            json=body,
            headers={"X-Pamer-Policy": "none"},
            timeout=timeout_s,
        )
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    data = response.json()
    ids, logprobs, before = data.get("prompt_token_ids"), data.get("prompt_logprobs"), scored.prompt_ids
    if not isinstance(ids, list) or not isinstance(logprobs, list) or ids[: len(before)] != before:
        return None
    values = []
    for token, entry in zip(ids[len(before) :], logprobs[len(before) :]):
        found = (entry or {}).get(str(token)) or (entry or {}).get(token)
        if not isinstance(found, dict) or not isinstance(found.get("logprob"), int | float):
            return None
        values.append(float(found["logprob"]))
    return (sum(values) / len(values), len(values)) if values else None
