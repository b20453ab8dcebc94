"""The serving adapter's request checks (``adapters/serving.py``): the tools a
chat template is given, as vLLM's server gives them."""

from __future__ import annotations

import pytest

from vllm_pamer.adapters.serving import template_tools, validate_chat_request

CLIENT = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("exclude, want", [(False, ["lookup"]), (True, None)])
def test_template_tools_follow_the_servers_tool_choice_none_rule(exclude, want):
    request = validate_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": CLIENT, "tool_choice": "none"}
    )
    tools = template_tools(request.tools, request.tool_choice, exclude_when_choice_none=exclude)
    assert (tools and [t["function"]["name"] for t in tools]) == want
