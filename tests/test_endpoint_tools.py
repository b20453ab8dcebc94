"""Which of a policy's own tools (SAM's ``memory``) the endpoint adds to a request."""

from __future__ import annotations

import pytest

from vllm_pamer.adapters.serving import template_tools, validate_chat_request
from vllm_pamer.channel import CaptureRecord
from vllm_pamer.core.policies.sam import memory_tool
from vllm_pamer.core.tokens import TokenCounter
from vllm_pamer.server.output import PamerReport
from vllm_pamer.server.tool_rounds import offered_tools

MEMORY = (memory_tool(5),)
CLIENT = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def offered(body, client_tools=CLIENT, auto_tools=True):
    report = PamerReport(session_id="s", policy="sam", action="rewritten")
    names = [t["function"]["name"] for t in offered_tools(MEMORY, body, client_tools, report, auto_tools)]
    return names, report.detail


@pytest.mark.parametrize(
    "body, auto_tools, want",
    [
        ({}, True, ["memory"]),
        ({"tool_choice": "auto"}, True, ["memory"]),
        ({}, False, []),  # vLLM refuses "auto" without a tool parser
        ({"tool_choice": "required"}, False, ["memory"]),
        ({"tool_choice": "none"}, True, []),
        ({"stream": True}, True, []),  # a streamed answer cannot be resolved by the server
    ],
)
def test_offered_only_where_the_server_can_answer_it(body, auto_tools, want):
    names, detail = offered(body, auto_tools=auto_tools)
    assert names == want
    if body == {} and not auto_tools:
        assert "--enable-auto-tool-choice" in detail


def test_never_shadows_a_client_tool_of_the_same_name():
    clash = [{"type": "function", "function": {"name": "memory", "parameters": {"type": "object"}}}]
    names, detail = offered({}, client_tools=clash)
    assert names == [] and "client has a tool of that name" in detail


# A template that renders the tools, as Qwen's or Llama's do (SmolLM2's does not).
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tools_counter(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = TOOLS_TEMPLATE
    return TokenCounter(tokenizer)


def test_prompt_token_counts_include_the_tools_the_engine_renders(tokenizer_dir):
    counter = tools_counter(tokenizer_dir)
    messages = [{"role": "user", "content": "find order 42"}]
    tools = CLIENT + [dict(t) for t in MEMORY]
    request = validate_chat_request({"model": "m", "messages": messages, "tools": tools})
    rendered = template_tools(request.tools, request.tool_choice, exclude_when_choice_none=False)
    assert [t["function"]["name"] for t in rendered] == ["lookup", "memory"]

    def count(tools):
        return counter.request(messages, tools)

    bare, client_only, both = count(None), count(rendered[:1]), count(rendered)
    assert bare < client_only < both  # each tool's schema is part of the prompt
    tokenizer = counter.tokenizer
    text = tokenizer.apply_chat_template(messages, tools=rendered, tokenize=False, add_generation_prompt=True)
    assert '"name": "memory"' in text
    assert both == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("exclude, want", [(False, ["lookup"]), (True, None)])
def test_template_tools_follow_the_servers_tool_choice_none_rule(exclude, want):
    request = validate_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": CLIENT, "tool_choice": "none"}
    )
    tools = template_tools(request.tools, request.tool_choice, exclude_when_choice_none=exclude)
    assert (tools and [t["function"]["name"] for t in tools]) == want


def test_report_takes_the_engines_prompt_count_when_the_policy_counted_none():
    record = CaptureRecord(key="k", request_id="r", session_id=None, num_prompt_tokens=321, hidden=b"")
    uncounted = PamerReport(session_id=None, policy="none", action="none")
    uncounted.add_capture(record)
    assert (uncounted.prompt_tokens_in, uncounted.prompt_tokens_out) == (321, 321)
    counted = PamerReport(session_id=None, policy="pamer", action="rewritten", prompt_tokens_in=900)
    counted.prompt_tokens_out = 300
    counted.add_capture(record)  # the policy's own counts stay
    assert (counted.prompt_tokens_in, counted.prompt_tokens_out) == (900, 300)
