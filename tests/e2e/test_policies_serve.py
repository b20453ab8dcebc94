"""End to end: every policy inside one real ``vllm-pamer serve``
(always-compress heads, short internal answers; tests/support/serve.py),
chosen per request by header, replaying the first steps of a real tau-bench
trajectory; and SAM's memory tool resolved by the server."""

from __future__ import annotations

import pytest
import requests

from tests.support.serve import TRAJECTORY, chat, client_for
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.policies.pamer.plus import EVIDENCE_HEADER
from vllm_pamer.core.policies.sam import CUES_HEADER
from vllm_pamer.core.policies.summary_writer import MEMORY_HEADER
from vllm_pamer.replay.compactions import tally
from vllm_pamer.trajectories import agent_requests, load_trajectories

pytestmark = pytest.mark.e2e

STEPS = 12
POLICIES = (
    "sliding_window",
    "discard_tool",
    "periodic_summary",
    "rolling_summary",
    "sam",
    "pamer_plus",
    "pamer_conversation",
)


@pytest.fixture(scope="module")
def runs(compress_server):
    trajectory = {t["id"]: t for t in load_trajectories(kind="tau")}[TRAJECTORY]
    client = client_for(compress_server)
    histories = [h for _, h in agent_requests(trajectory["messages"])][:STEPS]
    out = {}
    for policy in POLICIES:
        session = f"policies-{policy}"
        out[policy] = [(h, chat(client, h, session, policy).model_extra["pamer"]) for h in histories]
    return client, histories, out


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_sends_valid_requests_and_keeps_the_prefix(runs, policy):
    _, _, out = runs
    for history, report in out[policy]:
        assert report["policy"] == policy and not report["action"].startswith("fallback"), report
        sent = report["messages_sent"]
        assert protocol_issues(sent) == [] and sent[:2] == history[:2]
        assert report["prompt_tokens_out"] <= report["prompt_tokens_in"] or report["action"] == "recalled"
    last = out[policy][-1][1]
    assert last["prompt_tokens_out"] < last["prompt_tokens_in"], f"{policy} never shortened the request"


def test_summary_policies_store_and_send_their_summaries(runs):
    _, _, out = runs
    for policy in ("periodic_summary", "rolling_summary"):
        actions = [r["action"] for _, r in out[policy]]
        assert "compressed" in actions, (policy, actions)
        later = out[policy][-1][1]["messages_sent"]
        assert later[2]["content"].startswith(MEMORY_HEADER)
    rolling = out["rolling_summary"][-1][1]["messages_sent"]
    assert rolling[2]["content"].count("[memory ") == 1  # only the newest summary


def test_conversation_layout_summaries_are_stored_and_recalled(runs):
    """PaMER with ``summary_layout: conversation`` on the real engine: its
    summary requests (P + O + an instruction turn) are written and recalled."""
    _, _, out = runs
    actions = [r["action"] for _, r in out["pamer_conversation"]]
    assert "compressed" in actions and "recalled" in actions, actions
    for _, report in out["pamer_conversation"]:
        if report["action"] == "recalled":  # the summary sits right after P
            memory = report["messages_sent"][2]["content"]
            assert memory.startswith(MEMORY_HEADER) and len(memory) > len(MEMORY_HEADER) + 20, memory
            # the ids shown are reported, and each appears in the memory message
            assert report["recalled"] and all(f"[memory {i}]" in memory for i in report["recalled"]), report
        else:
            assert report["recalled"] is None


def test_pamer_plus_runs_its_selector_on_recalling_requests(runs, compress_server):
    """Each recalling request ran the schema-constrained selector on the real
    engine (never an engine failure), and what it sent follows the outcome:
    evidence after the memories only for a valid selection, nothing injected
    for an empty or a rejected one, and a rejection is logged with its reason
    (the 135M model seldom names valid steps: RESULTS)."""
    _, _, out = runs
    recalls = [r for _, r in out["pamer_plus"] if r["action"] == "recalled"]
    assert recalls
    events = requests.get(f"{compress_server.base_url}/pamer/sessions/policies-pamer_plus", timeout=30).json()
    rejections = [e for e in events["events"] if e["kind"] == "step_selection_rejected"]
    assert "step_recall_failure" not in [e["kind"] for e in events["events"]]
    rejected = 0
    for report in recalls:
        sent = report["messages_sent"]
        injected = [m for m in sent if str(m.get("content", "")).startswith(EVIDENCE_HEADER)]
        assert "step recall failed" not in report["detail"], report
        if "step evidence injected" in report["detail"]:
            assert len(injected) == 1 and sent[2]["content"].startswith(MEMORY_HEADER) and sent[3] is injected[0]
        else:
            assert not injected, report
            assert "summaries suffice" in report["detail"] or "step evidence rejected" in report["detail"], report
            rejected += "step evidence rejected" in report["detail"]
    assert len(rejections) == rejected and all(e["detail"]["reason"] for e in rejections)


def test_sam_pages_and_resolves_its_memory_tool(runs, compress_server):
    client, histories, out = runs
    reports = [r for _, r in out["sam"]]
    assert "compressed" in [r["action"] for r in reports]
    sent = reports[-1]["messages_sent"]
    assert sent[2]["content"].startswith(CUES_HEADER) and "[page 1]" in sent[2]["content"]
    # A memory call, forced with a regex (structured outputs) because a 135M model
    # cannot be relied on to write one: the server answers it and continues (the
    # regex forces the call again, so this also covers the cap on rounds), and
    # the client never sees a call of the server's own tool.
    call = r'<tool_call>\{"name": "memory", "arguments": \{"pages": \[1\], "goal": "[a-z ]{3,20}"\}\}</tool_call>'
    response = chat(
        client, histories[-1], "policies-sam", "sam", max_tokens=64, extra_body={"structured_outputs": {"regex": call}}
    )
    report = response.model_extra["pamer"]
    assert "resolved 3 memory tool round(s)" in report["detail"], (report, response.choices[0].message)
    assert not response.choices[0].message.tool_calls and response.choices[0].finish_reason == "stop"
    events = requests.get(f"{compress_server.base_url}/pamer/sessions/policies-sam", timeout=30).json()["events"]
    assert "memory_tool" in [e["kind"] for e in events]


def test_sam_blocks_leave_only_into_pages(runs, compress_server):
    _, _, out = runs
    session = requests.get(f"{compress_server.base_url}/pamer/sessions/policies-sam", timeout=30).json()
    paged = {b for m in session["memories"] for b in m["covered_block_ids"]}
    for history, report in out["sam"]:
        kept = {b.block_id for b in split_conversation(report["messages_sent"]).blocks}
        for block in split_conversation(history).blocks:
            assert block.block_id in kept or block.block_id in paged
    # the JSON view of a page: its cue and the blocks it holds, no embedding values
    for page in session["memories"]:
        assert page["embedder"] == "sam-page" and page["summary"] and page["covered_block_ids"], page
        assert "embedding" not in page and page["embedding_dim"] == 1
    assert len(paged) == sum(len(page["covered_block_ids"]) for page in session["memories"])  # no block twice


def test_every_compaction_started_on_the_server_ended(runs, compress_server):
    """The replay's audit (``replay/compactions.py``) on the real server's
    events: PaMER's compactions began and ended, none left open."""
    for policy in ("pamer_conversation",):
        url = f"{compress_server.base_url}/pamer/sessions/policies-{policy}"
        events = requests.get(url, params={"events": 1_000_000}, timeout=30).json()["events"]
        counts = tally(events)
        assert counts["started"] > 0 and counts["unended"] == 0, (policy, counts)
        assert counts["started"] == counts["compressed"] + counts["abandoned"] + counts["failed"], counts
