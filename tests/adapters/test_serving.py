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


class _Messages:
    """vLLM's Anthropic handler as far as the conversion reads it (its class
    methods; no engine behind it)."""

    _merge_inline_system = False

    def __init__(self) -> None:
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        self.to_chat_completion_request = AnthropicServingMessages.to_chat_completion_request


def test_an_anthropic_request_becomes_the_chat_request_vllm_makes_of_it():
    from vllm_pamer.adapters.serving import anthropic_chat_request
    from vllm_pamer.core.blocks import check_message_shape, protocol_issues

    body = {
        "model": "m",
        "max_tokens": 16,
        "system": "You book flights.",
        "messages": [
            {"role": "user", "content": "Cancel reservation H9ZU1C."},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking it up."},
                    {"type": "tool_use", "id": "t1", "name": "get_reservation", "input": {"id": "H9ZU1C"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "status: active"}]},
        ],
        "vllm_xargs": {"mine": 1},
    }
    chat = anthropic_chat_request(body, _Messages()).model_dump(exclude_unset=True)
    messages = check_message_shape(chat["messages"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["tool_calls"][0]["function"]["name"] == "get_reservation"
    assert messages[3]["tool_call_id"] == "t1" and protocol_issues(messages) == []
    assert chat["max_tokens"] == 16 and chat["vllm_xargs"] == {"mine": 1}
    validate_chat_request(chat)  # what the chat route reads next


def test_an_anthropic_request_vllm_would_refuse_raises_its_request_error():
    from vllm_pamer.adapters.serving import REQUEST_ERRORS, anthropic_chat_request

    with pytest.raises(REQUEST_ERRORS):
        anthropic_chat_request({"model": "m", "messages": "not a list", "max_tokens": 8}, _Messages())
    with pytest.raises(REQUEST_ERRORS):  # max_tokens is required there
        anthropic_chat_request({"model": "m", "messages": []}, _Messages())
