"""SAM (pages, cues, the memory tool) on a real SQLite store with scripted
engine services. The server's tool loop runs in tests/e2e/test_policies_serve.py."""

from __future__ import annotations

import asyncio
import json

from tests.support.fakes import FakeEngine, blocking, conversation
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, PolicyRequest, create_policy
from vllm_pamer.core.policies.sam import CUES_HEADER, MEMORY_TOOL_NAME, paginate


class SamServices(FakeEngine):
    max_model_len = 4096

    def __init__(self, fail=None):
        super().__init__()
        self.fail, self.prompts = fail, []

    async def complete(self, messages, max_tokens, json_schema=None, kind="internal"):
        self.prompts.append((kind, messages[-1]["content"]))
        if self.fail == kind:
            raise RuntimeError(f"{kind} failed")
        ids = sorted({w for w in messages[-1]["content"].split() if w.startswith("ID")})
        return f"{kind}: " + " ".join(ids)


def run(messages, store, services, **options):
    policy = create_policy("sam", {"trigger_tokens": 1500, "page_tokens": 700, "call_attempts": 1, **options})
    return policy, asyncio.run(
        rewrite_request(
            policy,
            PolicyRequest(
                messages=messages, session_id="s", previous_vote=None, context=PolicyContext(store, services)
            ),
        )
    )


def test_paginate_respects_the_budget_and_keeps_order():
    blocks = split_conversation(conversation(5)).blocks
    assert paginate(blocks, [300, 300, 300, 900, 100], 700) == [
        [blocks[0], blocks[1]],
        [blocks[2]],
        [blocks[3]],
        [blocks[4]],
    ]


def test_consolidation_pages_old_blocks_and_lists_cues(store):
    messages = conversation(8, chars=900)  # ~230 tokens a block
    _, out = run(messages, store, SamServices())
    assert out.action == "compressed" and protocol_issues(out.messages) == []
    blocks = split_conversation(messages).blocks
    assert out.messages[:2] == messages[:2]
    assert out.messages[2]["content"].startswith(CUES_HEADER)
    assert out.messages[3:] == list(blocks[-2].messages) + list(blocks[-1].messages)
    assert [t["function"]["name"] for t in out.extra_tools] == [MEMORY_TOOL_NAME]
    pages = blocking(store).load("s").memories
    assert [b for p in pages for b in p.covered_block_ids] == [b.block_id for b in blocks[:-2]]
    assert len(pages) > 1
    for page in pages:  # within the page budget, or one block alone
        raw = blocking(store).raw_blocks("s", list(page.covered_block_ids))
        sizes = [SamServices().count_tokens(raw[b]) for b in page.covered_block_ids]
        assert sum(sizes) <= 700 or len(sizes) == 1
    assert "[page 3]" in out.messages[2]["content"]
    # the next request keeps the cues and the live blocks; no new pages below the trigger
    _, again = run(conversation(9, chars=900), store, SamServices())
    assert again.action == "rewritten" and again.messages[2] == out.messages[2]


def test_memory_tool_reconstructs_from_the_named_pages(store):
    policy, _ = run(conversation(8, chars=900), store, SamServices())
    services = SamServices()
    context = PolicyContext(store, services)
    text = asyncio.run(
        policy.resolve_tool_call("s", MEMORY_TOOL_NAME, json.dumps({"pages": [1], "goal": "ID1?"}), context)
    )
    assert text.startswith("recall:") and "ID0" in text and "ID5" not in text
    for bad in ('{"pages": [99], "goal": "x"}', '{"pages": []}', "not json", '{"pages": [1,2,3,4,5,6], "goal": "x"}'):
        assert asyncio.run(policy.resolve_tool_call("s", MEMORY_TOOL_NAME, bad, context)).startswith("memory error")


def test_cue_failure_sends_the_request_unchanged(store):
    messages = conversation(8, chars=900)
    _, out = run(messages, store, SamServices(fail="cue"))
    assert out.action == "fallback:summary_failure" and out.messages == messages
    assert blocking(store).load("s").memories == []


def test_below_trigger_without_pages_is_untouched(store):
    messages = conversation(3, chars=100)
    _, out = run(messages, store, SamServices())
    assert out.action == "none" and out.messages == messages and out.extra_tools == ()
