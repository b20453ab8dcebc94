"""The one token count (``core/tokens.py``): a block counted by its span as the
request renders it, and a request counted with the tools the engine's
template renders."""

from __future__ import annotations

import json

from vllm_pamer.adapters.serving import template_tools, validate_chat_request
from vllm_pamer.core.policies.sam import memory_tool
from vllm_pamer.core.render import render_tools_as_text, template_supports_tools
from vllm_pamer.core.tokens import TokenCounter


def test_a_span_counts_the_calls_a_template_without_tools_would_drop(tokenizer_dir):
    """Budgets count blocks by span: rendered as the request renders them, so
    a block's calls count, and the blocks of a request add up to about its count."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert not template_supports_tools(tokenizer.chat_template)
    counter = TokenCounter(tokenizer, render=render_tools_as_text)
    long_command = "grep -rn 'def resolve_lookup' django/db/models/ " * 20
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"cmd": long_command})},
    }
    block = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    assert counter.span(block) > len(tokenizer.encode(long_command, add_special_tokens=False))
    request = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix it."}, *block]
    parts = counter.span(request[:2]) + counter.span(block)
    assert abs(parts - counter.request(request)) <= 0.1 * counter.request(request)


MEMORY = (memory_tool(5),)
CLIENT = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


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
