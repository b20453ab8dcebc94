"""End to end: the PaMER controller inside a real ``vllm-pamer serve`` of the
default model, with heads that always vote "compress", on a long real
trajectory; and a crash (SIGKILL) in the middle of a compression."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time

import pytest
import requests

from tests.support.fakes import blocking
from tests.support.serve import TRAJECTORY, chat, client_for, start_pamer_server
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.policies.summary_writer import MEMORY_HEADER
from vllm_pamer.replay.compactions import tally
from vllm_pamer.stores.sqlite import SqliteStore
from vllm_pamer.trajectories import agent_requests, load_trajectories

pytestmark = pytest.mark.e2e

STEPS = 14  # enough for two compressions and the recalls after them


@pytest.fixture(scope="module")
def trajectory():
    return {t["id"]: t for t in load_trajectories(kind="tau")}[TRAJECTORY]


@pytest.fixture(scope="module")
def pamer_run(compress_server, trajectory):
    client = client_for(compress_server)
    steps = [
        (history, chat(client, history, "pamer-e2e").model_extra["pamer"])
        for _, history in list(agent_requests(trajectory["messages"]))[:STEPS]
    ]
    session = requests.get(f"{compress_server.base_url}/pamer/sessions/pamer-e2e", timeout=30).json()
    no_session = chat(client, trajectory["messages"][:6]).model_extra["pamer"]
    return steps, session, no_session, compress_server.store_path


def _block_ids(messages):
    return [b.block_id for b in split_conversation(messages).blocks]


def test_compression_then_recall_on_a_real_trajectory(pamer_run):
    steps, _, _, _ = pamer_run
    actions = [report["action"] for _, report in steps]
    assert "compressed" in actions and "recalled" in actions
    first = actions.index("compressed")
    assert all(a == "none" for a in actions[:first])  # gate not reached yet (or no vote at step 0)
    for history, report in steps:
        sent = report["messages_sent"]
        assert protocol_issues(sent) == []
        assert report["captured"] and report["votes"] == 5 and report["compress_vote"] is True
        if report["action"] == "compressed":
            assert report["prompt_tokens_out"] < report["prompt_tokens_in"]
            assert MEMORY_HEADER not in json.dumps(sent)  # no recall on the compressing request
        if report["action"] == "recalled":
            assert sent[:2] == history[:2]
            assert sent[2]["content"].startswith(MEMORY_HEADER)  # right after the prefix
            assert MEMORY_HEADER not in json.dumps(sent[3:])
            # recalled with the state captured at the previous request (no query embedding)
            assert "query: state captured at the previous request" in report["detail"], report
    # once the worker holds the session's memories, the capture searched them there
    assert any("searched in the worker" in r["detail"] for _, r in steps if r["action"] == "recalled"), actions
    # once memory exists, prompts stay well below the raw history
    last_in, last_out = steps[-1][1]["prompt_tokens_in"], steps[-1][1]["prompt_tokens_out"]
    assert last_out < 0.8 * last_in


def test_store_covers_exactly_the_removed_blocks(pamer_run):
    steps, session, _, store_path = pamer_run
    memories = session["memories"]
    assert memories and all(m["summary"].strip() for m in memories)
    covered = {b for m in memories for b in m["covered_block_ids"]}
    store = SqliteStore(store_path)
    raw = blocking(store).raw_blocks("pamer-e2e", sorted(covered))
    assert set(raw) == covered  # every archived block is kept raw for later
    for history, report in steps:
        kept = set(_block_ids(report["messages_sent"]))
        for block_id in _block_ids(history):
            assert block_id in kept or block_id in covered, "a block left the context without a memory"
    kinds = [e["kind"] for e in session["events"]]
    assert kinds.count("compressed") == len(memories)


def test_fallback_is_reported(pamer_run):
    _, _, no_session, _ = pamer_run
    assert no_session["action"] == "fallback:missing_session_id"


def test_crash_in_the_middle_of_a_compression(compress_heads, trajectory, tmp_path):
    """SIGKILL while a summary is being written; restart on the same store and
    replay the session: no raw block lost, no dangling memory, it continues."""
    store_path = tmp_path / "memory.sqlite3"
    requests_ = list(agent_requests(trajectory["messages"]))[:STEPS]
    server = start_pamer_server(compress_heads, store_path, tmp_path / "first.log")
    watcher = SqliteStore(store_path)
    killed_at = None
    try:
        client = client_for(server)
        for step, (_, history) in enumerate(requests_):
            before = len(blocking(watcher).events("crash"))
            errors = []
            worker = threading.Thread(target=lambda: errors.append(_try(chat, client, history, "crash")))
            worker.start()
            deadline = time.monotonic() + 120
            while worker.is_alive() and time.monotonic() < deadline:
                new = [e["kind"] for e in blocking(watcher).events("crash")[before:]]
                if "compression_started" in new and "compressed" not in new:
                    server.kill()  # mid-compression
                    killed_at = step
                    break
                time.sleep(0.05)
            worker.join(timeout=60)
            if killed_at is not None:
                break
    finally:
        server.stop()
    assert killed_at is not None, "no compression started"
    # the kill lands while the summary is written or, when the summary is short, after its
    # commit: either way no memory is stored without the raw blocks it covers (one transaction)
    first = blocking(watcher).load("crash")
    first_covered = [b for m in first.memories for b in m.covered_block_ids]
    assert set(blocking(watcher).raw_blocks("crash", first_covered)) == set(first_covered)

    events_before_restart = len(blocking(watcher).events("crash", limit=10_000))
    server = start_pamer_server(compress_heads, store_path, tmp_path / "second.log")
    try:
        client = client_for(server)
        reports = [chat(client, h, "crash").model_extra["pamer"] for _, h in requests_[killed_at:]]
    finally:
        server.stop()
    assert all(not r["action"].startswith("fallback") for r in reports)
    # the vote and state captured before the kill came back from the store
    after = [e["kind"] for e in blocking(watcher).events("crash", limit=10_000)[events_before_restart:]]
    assert "probe_missing" not in after, after
    assert "compressed" in [r["action"] for r in reports]  # the session goes on compressing
    loaded = blocking(SqliteStore(store_path)).load("crash")
    assert loaded.discarded == 0 and loaded.memories
    covered = [b for m in loaded.memories for b in m.covered_block_ids]
    assert len(covered) == len(set(covered))
    assert set(blocking(SqliteStore(store_path)).raw_blocks("crash", covered)) == set(covered)
    for (_, history), report in zip(requests_[killed_at:], reports):
        kept = set(_block_ids(report["messages_sent"]))
        assert all(b in kept or b in covered for b in _block_ids(history))


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # the request dies with the server
        return exc


def test_window_guard_compresses_a_first_request_longer_than_the_window(compress_server, trajectory):
    """A session's first request has no vote yet, and one longer than the
    window is never prefilled, so it would never get one: PaMER compresses it
    without the vote, and the engine answers instead of refusing."""
    client = client_for(compress_server)
    history = next(h for step, (_, h) in enumerate(agent_requests(trajectory["messages"])) if step == 19)
    report = chat(client, history, "pamer-window").model_extra["pamer"]
    assert report["action"] == "compressed" and "longer than the window" in report["detail"], report
    assert report["prompt_tokens_in"] >= 8192 > report["prompt_tokens_out"]
    assert protocol_issues(report["messages_sent"]) == []


BUDGET_STEPS = 24  # the budget of "pamer_budget" (tests/support/serve.py) is reached twice in these


@pytest.fixture(scope="module")
def budget_run(compress_server, trajectory):
    client = client_for(compress_server)
    out = []
    for _, history in list(agent_requests(trajectory["messages"]))[:BUDGET_STEPS]:
        response = chat(client, history, "pamer-budget-e2e", "pamer_budget")
        out.append((history, response.model_extra["pamer"], response.usage))
    session = requests.get(f"{compress_server.base_url}/pamer/sessions/pamer-budget-e2e", timeout=30).json()
    metrics = requests.get(f"{compress_server.base_url}/metrics", timeout=30).text
    return out, session, metrics


def test_budget_schedule_is_served_from_the_prefix_cache_between_compactions(budget_run):
    """Between two compactions what is sent only grows, so vLLM serves it from
    its prefix cache: each request reuses all the previous one computed but its
    last partial KV block, and cache hits are >= 80% of the prompt tokens of
    the requests between compactions (the rest: the new steps)."""
    steps, _, metrics = budget_run
    block = int(re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', metrics).group(1))
    reports = [report for _, report, _ in steps]
    usage = [(u.prompt_tokens, u.prompt_tokens_details.cached_tokens) for _, _, u in steps]
    compactions = [i for i, r in enumerate(reports) if r["action"] == "compressed"]
    assert len(compactions) >= 2, [r["action"] for r in reports]
    between = [i for first, second in itertools.pairwise(compactions) for i in range(first + 1, second)]
    assert between, "compactions back to back"
    for i in between:
        if i - 1 not in compactions:
            now, later = reports[i - 1]["messages_sent"], reports[i]["messages_sent"]
            assert later[: len(now)] == now  # append-only
        assert usage[i][1] >= usage[i - 1][0] - block, (i, usage)  # all of the previous request reused
    prompt = sum(usage[i][0] for i in between)
    cached = sum(usage[i][1] for i in between)
    assert cached >= 0.8 * prompt, f"cache hits {cached}/{prompt} between compactions {compactions}: {usage}"
    for report in reports:
        schedule = report["schedule"]
        assert schedule["budget"] == 4800 and schedule["band_low"] == 3600
        assert protocol_issues(report["messages_sent"]) == []
    for i in compactions:  # always-compress heads: each fires on the vote, inside the band or at its top
        assert reports[i]["schedule"]["trigger"] in ("vote", "top_of_band")
        assert reports[i]["schedule"]["cache_break_tokens"] > 0


def test_budget_schedule_is_visible_in_the_session_and_the_metrics(budget_run):
    _, session, metrics = budget_run
    assert session["last_schedule"]["budget"] == 4800
    compressed = [e for e in session["events"] if e["kind"] == "compressed"]
    assert compressed and all(e["detail"]["trigger"] and e["detail"]["cache_break_tokens"] > 0 for e in compressed)
    assert "vllm_pamer_cache_break_tokens_total" in metrics
    assert 'vllm_pamer_compactions_total{policy="pamer_budget"' in metrics
    inline = r'^vllm_pamer_memory_write_seconds_count\{mode="inline",policy="pamer_budget"\} (\S+)$'
    waited = re.search(inline, metrics, re.M)  # each compaction's request waited for its memory (other sessions too)
    assert waited and float(waited.group(1)) >= len(compressed)
    assert re.search(r'^vllm_pamer_request_wait_seconds_count\{policy="pamer_budget"\} [1-9]', metrics, re.M)
    memories = [m["summary"] for m in session["memories"]]
    assert all("Record of the archived steps" in m for m in memories)
    assert any("called " in m for m in memories)  # calls kept verbatim


def test_summaries_written_after_their_compaction(compress_server, trajectory):
    """``summary_after`` on the real server: each compaction commits the
    record alone and the request goes on; the summaries are written by the
    same engine in the background and land in the stored memories; what is
    sent between compactions only grows at its end; every compaction ended."""
    client = client_for(compress_server)
    reports = []
    for _, history in list(agent_requests(trajectory["messages"]))[:BUDGET_STEPS]:
        reports.append(chat(client, history, "pamer-after-e2e", "pamer_after").model_extra["pamer"])
    compactions = [i for i, r in enumerate(reports) if r["action"] == "compressed"]
    assert len(compactions) >= 2, [r["action"] for r in reports]
    for i in range(1, len(reports)):
        if i not in compactions:
            before, now = reports[i - 1]["messages_sent"], reports[i]["messages_sent"]
            assert now[: len(before)] == before  # append-only, though summaries landed in between
    url = f"{compress_server.base_url}/pamer/sessions/pamer-after-e2e"
    deadline = time.monotonic() + 300
    while True:  # the summaries end in the background
        session = requests.get(url, params={"events": 1_000_000}, timeout=30).json()
        counts = tally(session["events"])
        if counts["summaries_added"] + counts["summaries_not_added"] >= counts["summaries_after"]:
            break
        assert time.monotonic() < deadline, counts
        time.sleep(2)
    assert counts["started"] == counts["compressed"] == len(compactions), counts
    # one summary pending per session: a compaction while one is written leaves its own unwritten
    assert 1 <= counts["summaries_after"] <= len(compactions), counts
    assert counts["unended"] == 0 and counts["summaries_added"] >= 1, counts
    summarized = [m["summary"] for m in session["memories"] if not m["summary"].startswith("Record of")]
    assert len(summarized) == counts["summaries_added"]
    assert all("\n\nRecord of the archived steps" in text for text in summarized)
    for report in reports:
        assert protocol_issues(report["messages_sent"]) == []
