"""Which of a policy's own tools (SAM's ``memory``) the endpoint adds to a
request (``server/tool_rounds.py``)."""

from __future__ import annotations

import pytest

from vllm_pamer.core.policies.sam import memory_tool
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
