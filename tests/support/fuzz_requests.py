"""A fuzzer of requests to every managed route (``ROUTES``: chat completions,
the Responses API, the Anthropic Messages API, ``/invocations``) built from
real trajectory requests, and the check every answer must pass: a 4xx in an
error format, or a valid answer; never a 5xx. Shared by the end-to-end suite (``tests/e2e/test_fuzz_serve.py``)
and the long run (``benchmarks/adversarial.py``).

A request is a real agent request (the shipped tau-bench and mini-swe
samples, its first messages, each text cut short so a valid request prefills
in about a second on a CPU) with a few mutations drawn from what hostile or
careless clients send: bodies that are not JSON or nest deeply, messages of
the wrong shape, broken tool protocols, lone surrogates, fields of the wrong
type or range, odd session ids, policies and budgets, in the body or the
headers; on the other routes the same mutated chat request in that API's
shape where it still has one (else the mutated value as it is), plus that
API's own fields (a ``previous_response_id`` never made, ``store``). Valid
requests ask for one or two tokens. ``FUZZ_SERVER_ARGS``: the
server both fuzz it (PaMER, an API key, a 2,048-token window).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from vllm_pamer.default_model import DEFAULT_MODEL_NAME
from vllm_pamer.trajectories import agent_requests, load_trajectories

MAX_MESSAGES = 6
TEXT_CHARS = 300
KEY = "fuzz-key"
FUZZ_SERVER_ARGS = ["--pamer-policy", "pamer", "--max-model-len", "2048", "--enforce-eager", "--api-key", KEY]


def _cut(message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if isinstance(out.get("content"), str):
        out["content"] = out["content"][:TEXT_CHARS]
    return out


def real_requests() -> list[list[dict[str, Any]]]:
    """Agent requests of the shipped samples: at most ``MAX_MESSAGES``
    messages each (a whole number of tool rounds), texts cut short."""
    requests = []
    for kind in ("tau", "swe"):
        for trajectory in load_trajectories(kind=kind)[:4]:
            for i, history in agent_requests(trajectory["messages"]):
                if i <= MAX_MESSAGES:
                    requests.append([_cut(m) for m in history])
    return requests


REQUESTS = real_requests()

odd_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "*", "%", "../..", "\x00", "\ud800", "\udfff x", "é" * 300, "a" * 5000, "null"]),
)
odd_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    odd_text,
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


DEEP = "__deep_{}__"
"""Stands for JSON nested that many levels, written into the body's text
(deeper than ``json`` can encode)."""


def _deepen(text: str) -> str:
    return re.sub(r'"__deep_(\d+)__"', lambda m: '{"k": [' * int(m[1]) + "0" + "]}" * int(m[1]), text)


def _drop_tool_result(body: dict, draw) -> None:
    tools = [i for i, m in enumerate(body["messages"]) if m.get("role") == "tool"]
    if tools:
        del body["messages"][draw(st.sampled_from(tools))]


def _orphan_tool_result(body: dict, draw) -> None:
    body["messages"].append({"role": "tool", "tool_call_id": draw(odd_text), "content": "stray"})


def _set_message_field(body: dict, draw) -> None:
    message = draw(st.sampled_from(body["messages"]))
    message[draw(st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name", "extra"]))] = draw(odd_value)


def _shuffle(body: dict, draw) -> None:
    body["messages"] = draw(st.permutations(body["messages"]))


def _duplicate_call_id(body: dict, draw) -> None:
    for message in body["messages"]:
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            calls.append(dict(calls[0]))
            return


def _bad_arguments(body: dict, draw) -> None:
    for message in body["messages"]:
        calls = message.get("tool_calls")  # (an earlier mutation may have made it anything)
        for call in calls if isinstance(calls, list) else []:
            if not isinstance(call, dict):
                continue
            call["function"] = draw(
                st.one_of(odd_value, st.fixed_dictionaries({"name": odd_text, "arguments": odd_value}))
            )
            return


def _surrogate(body: dict, draw) -> None:
    draw(st.sampled_from(body["messages"]))["content"] = "before \ud800 after"


def _messages_value(body: dict, draw) -> None:
    body["messages"] = draw(st.one_of(odd_value, st.just([]), st.lists(odd_value, min_size=1, max_size=3)))


def _field(body: dict, draw) -> None:
    name = draw(
        st.sampled_from(
            [
                "max_tokens",
                "max_completion_tokens",
                "temperature",
                "top_p",
                "n",
                "stream",
                "stop",
                "tools",
                "tool_choice",
                "response_format",
                "logprobs",
                "seed",
                "model",
                "session_id",
                "pamer_policy",
                "pamer_context_budget",
                "pamer_echo",
                "vllm_xargs",
                "chat_template_kwargs",
                "unknown_field",
            ]
        )
    )
    body[name] = draw(odd_value)


def _deep(body: dict, draw) -> None:
    body[draw(st.sampled_from(["tools", "vllm_xargs", "metadata", "messages"]))] = DEEP.format(
        draw(st.sampled_from([31, 33, 100, 500, 2_500]))  # twice as many levels: an object and a list each
    )


def _huge_text(body: dict, draw) -> None:
    draw(st.sampled_from(body["messages"]))["content"] = "word " * draw(st.sampled_from([10_000, 40_000]))


MUTATIONS: list[Callable[[dict, Any], None]] = [
    _drop_tool_result,
    _orphan_tool_result,
    _set_message_field,
    _shuffle,
    _duplicate_call_id,
    _bad_arguments,
    _surrogate,
    _messages_value,
    _field,
    _field,
    _deep,
    _huge_text,
]


WHOLE_BODY = (_field, _deep, _messages_value)


class FuzzedRequest:
    def __init__(self, headers: dict[str, bytes], content: bytes, what: list[str]) -> None:
        self.headers, self.content, self.what = headers, content, what

    def __repr__(self) -> str:
        return f"FuzzedRequest({self.what}, headers={self.headers}, body={self.content[:300]!r}...)"


ROUTES = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "invocations": "/invocations",
}
"""The managed routes the fuzzer sends to, by the API they speak."""
ANSWER_FIELD = {"chat": "choices", "responses": "output", "messages": "content", "invocations": "choices"}
"""The field a valid answer of each route has."""


def _as_api(body: dict[str, Any], api: str, draw) -> dict[str, Any]:
    """The (maybe mutated) chat ``body`` in ``api``'s shape, where its
    messages still convert; else the messages value as that API's field."""
    from tests.support.anthropic_messages import to_anthropic
    from vllm_pamer.core.response_items import response_items

    if api in ("chat", "invocations"):
        return body
    messages = body.pop("messages", None)
    try:
        if api == "responses":
            instructions, converted = response_items(messages)
            body.update(input=converted, instructions=instructions)
        else:
            system, converted = to_anthropic(messages)
            body.update(messages=converted, system=system)
    except Exception:  # a mutated shape no client of that API would send: it goes as it is
        body["input" if api == "responses" else "messages"] = messages
    if api == "responses":
        body["max_output_tokens"] = body.pop("max_tokens", None)
        if draw(st.integers(0, 5)) == 5:  # (integers lean to 0: the common case goes first)
            body["previous_response_id"] = draw(st.sampled_from(["resp_never_made", "", "x" * 300]))
        if draw(st.integers(0, 5)) == 5:
            body["store"] = draw(st.sampled_from([False, True, "yes"]))
    return body


@st.composite
def fuzzed_requests(draw, key: str | None = None, api: str = "chat") -> FuzzedRequest:
    """One request to ``api``'s route: a real one, maybe mutated, as bytes with its headers."""
    messages = json.loads(json.dumps(draw(st.sampled_from(REQUESTS))))
    body: dict[str, Any] = {
        "model": DEFAULT_MODEL_NAME,
        "messages": messages,
        "max_tokens": draw(st.sampled_from([1, 2])),
        "temperature": 0,
    }
    what = []
    for mutation in draw(st.lists(st.sampled_from(MUTATIONS), max_size=3)):
        shaped = isinstance(body["messages"], list) and body["messages"]
        if mutation in WHOLE_BODY or (shaped and all(isinstance(m, dict) for m in body["messages"])):
            mutation(body, draw)  # (a message mutation needs messages that are still objects)
            what.append(mutation.__name__.strip("_"))
    body = _as_api(body, api, draw)
    headers: dict[str, bytes] = {"content-type": b"application/json"}
    # (sampled_from leans to its first element, integers to 0: the common case goes first)
    if key is not None and draw(st.sampled_from([True] * 19 + [False])):  # mostly with the key
        headers["authorization"] = f"Bearer {key}".encode()
    for name, values in (
        ("x-session-id", st.one_of(st.just("fuzz-session"), odd_text.map(str), st.binary(min_size=1, max_size=40))),
        ("x-pamer-policy", st.sampled_from(["pamer", "none", "recent_k", "sam", "pamer_plus", "nope", ""])),
        ("x-pamer-context-budget", st.sampled_from(["4096", "0", "-5", "1e9", "x", "99999999999999999999"])),
        ("x-pamer-echo", st.sampled_from(["1", "true", "0", "maybe"])),
    ):
        if draw(st.integers(0, 3)) == 0:
            value = draw(values)
            raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
            if all(32 <= b < 127 or b >= 128 for b in raw) and raw.strip() == raw and raw:  # what HTTP can carry
                headers[name] = raw
                what.append(name)
    shape = draw(st.sampled_from(["body"] * 22 + ["raw bytes", "cut JSON", "not an object"]))
    if shape == "raw bytes":
        content = draw(st.binary(max_size=200))
        what.append(shape)
    elif shape == "cut JSON":
        content = _deepen(json.dumps(body))[: draw(st.integers(0, 200))].encode()
        what.append(shape)
    elif shape == "not an object":
        content = json.dumps(draw(st.one_of(st.lists(st.integers()), st.integers(), odd_text))).encode()
        what.append(shape)
    else:
        content = _deepen(json.dumps(body)).encode()
    return FuzzedRequest(headers, content, what)


def fuzz_settings(examples: int, derandomize: bool = True) -> settings:
    """How both runs drive the fuzzer: ``examples`` requests, no deadline (an
    engine answers in seconds), no example database, no health checks (the
    requests are large by design)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def check_answer(response: httpx.Response, api: str = "chat") -> None:
    """A 4xx with an error object, or a 200 with ``api``'s answer; never a 5xx."""
    assert response.status_code < 500, f"HTTP {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error, str) or error["message"], response.text[:500]  # vLLM's 401 is a bare string
        return
    assert response.status_code == 200, response.text[:500]
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                error = chunk.get("error") if isinstance(chunk.get("error"), dict) else {}
                assert error.get("code", 400) < 500, line[:500]
        return
    assert ANSWER_FIELD[api] in response.json(), response.text[:500]


def send(client: httpx.Client, request: FuzzedRequest, api: str = "chat") -> httpx.Response:
    return client.post(ROUTES[api], content=request.content, headers=request.headers)
