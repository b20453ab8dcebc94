"""The replay report (``replay/report.py``) on synthetic records with known
table values (tests/support/replay.py's ``RECORDS`` and ``RUNS``)."""

from __future__ import annotations

import json

import msgspec
import pytest

from tests.support.markdown import cells, table
from tests.support.replay import RECORDS, RUNS, SWE, rec
from vllm_pamer.replay.evidence import (
    availability,
    context_chars,
    evidence_messages,
    needed_values,
    recency_frontier,
    recent_k_context,
    trajectory_kind,
)
from vllm_pamer.replay.records import RunSummary, StepRecord, read_records, read_runs
from vllm_pamer.replay.report import jaccard, markdown_table, summarize, write_report
from vllm_pamer.trajectories import agent_requests, load_trajectories


def test_policy_rows_known_values():
    none, recent = summarize(RECORDS, RUNS)
    assert (none.policy, none.requests, none.answered, none.beyond_window, none.errors) == ("none", 4, 3, 1, 0)
    assert none.tokens_per_trajectory == pytest.approx((110 + 210 + 305) / 2)
    assert none.mean_peak_context == pytest.approx((200 + 300) / 2)
    assert none.prefill_computed == 600
    assert none.peak_kv_usage == 0.5
    assert none.steps_per_min == pytest.approx(3.0)
    assert none.preemptions == 3
    assert none.evidence_availability == pytest.approx(4 / 4)
    assert none.chars_share == pytest.approx(1.0)
    assert none.agree_tool is None and none.agree_args is None  # the baseline itself

    assert recent.answered == 4 and recent.beyond_window == 0
    assert recent.internal_tokens == 120
    assert recent.tokens_per_trajectory == pytest.approx((110 + 160 + 255 + 280 + 120) / 2)
    assert recent.mean_peak_context == pytest.approx((150 + 260) / 2)
    assert recent.prefill_computed == 200
    assert recent.steps_per_min == pytest.approx(8.0)
    assert recent.preemptions is None  # not exported: shown as "-", not as zero
    assert recent.evidence_availability == pytest.approx((2 + 0 + 1 + 1) / (2 + 0 + 2 + 4))
    assert recent.chars_share == pytest.approx((100 + 120 + 200 + 100) / (100 + 200 + 300 + 400))
    # compared on the steps both answered (B/1 was beyond the window under none)
    assert recent.agree_tool == pytest.approx(2 / 3)  # A/0 same, A/1 text vs call, B/0 same
    assert recent.agree_args == pytest.approx((1.0 + 0.0 + 0.5) / 3)


def test_without_baseline_no_agreement_and_missing_metrics():
    run = RunSummary(policy="recent_k", trajectories=2, requests=4, elapsed_s=30.0)
    (row,) = summarize([r for r in RECORDS if r.policy == "recent_k"], [run])
    assert row.agree_tool is None and row.prefill_computed is None and row.peak_kv_usage is None
    assert row.tokens_per_trajectory == pytest.approx((110 + 160 + 255 + 280) / 2)


def test_jaccard():
    assert jaccard([], []) == 1.0
    assert jaccard(["a"], []) == 0.0
    assert jaccard(["a", "b"], ["b", "c"]) == pytest.approx(1 / 3)


def test_markdown_table_and_files(tmp_path):
    rows = write_report(tmp_path, RECORDS, RUNS)
    shown = table(markdown_table(rows))
    assert list(shown) == ["none", "recent_k"]
    # answered / min (refused excluded) beside requests / min; no compaction, no cache break
    none = {
        "trajectories": "2",
        "requests answered": "3",
        "beyond window": "1",
        "tokens / trajectory": "312",
        "mean peak context": "250",
        "prefill computed": "600",
        "peak KV": "50.0%",
        "answered / min": "3.00",
        "requests / min": "4.00",
        "preemptions": "3",
        "cache hits": "-",
        "compactions": "0",
        "cache-break tokens": "0",
        "recall changes": "-",
        "evidence availability": "100.0%",
        "chars share": "100.0%",
    }
    assert cells(shown["none"], *none) == none
    recent = {
        "trajectories": "2",
        "requests answered": "4",
        "beyond window": "0",
        "same tool as none": "66.7%",
        "arg overlap with none": "0.50",
    }
    assert cells(shown["recent_k"], *recent) == recent
    assert "inserted chars / request" not in (tmp_path / "report.md").read_text()  # neither inserts anything
    spent = [msgspec.structs.replace(r, inserted={"calls": 30}) if r.policy == "recent_k" else r for r in RECORDS]
    write_report(tmp_path / "spent", spent, RUNS)
    assert "| recent_k | 30 | 0.0% | 100.0% |" in (tmp_path / "spent" / "report.md").read_text()
    assert read_records(tmp_path / "records.jsonl") == RECORDS
    assert [r.policy for r in read_runs(tmp_path / "runs.json")] == ["none", "recent_k"]
    assert json.loads((tmp_path / "summary.json").read_text())[1]["agree_tool"] == pytest.approx(2 / 3)
    assert (tmp_path / "context_per_turn.png").read_bytes()[:4] == b"\x89PNG"
    assert "context_per_turn.png" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "cost_vs_evidence.png").read_bytes()[:4] == b"\x89PNG"
    assert "latency_per_step.png" in (tmp_path / "report.md").read_text()
    assert "cost_vs_evidence.png" in (tmp_path / "report.md").read_text()


def test_runs_of_one_policy_merge_and_kinds_get_their_own_tables(tmp_path):
    """A benchmark runs every policy per group of trajectories: the rows add
    the groups up; with tau and swe groups, each kind gets a table and a plot."""
    tau = [msgspec.structs.replace(r, kind="tau") for r in RECORDS if r.trajectory_id == "A"]
    swe = [msgspec.structs.replace(r, kind="swe") for r in RECORDS if r.trajectory_id == "B"]
    runs = [
        RunSummary(
            policy=p,
            trajectories=1,
            requests=2,
            elapsed_s=t,
            kind=k,
            group=g,
            kv_usage_peak=kv,
            metric_deltas={"vllm:prefix_cache_queries_total": q, "vllm:prefix_cache_hits_total": h},
        )
        for p, t, k, g, kv, q, h in [
            ("none", 20.0, "tau", "tau-0", 0.5, 400.0, 100.0),
            ("recent_k", 10.0, "tau", "tau-0", 0.1, 200.0, 100.0),
            ("none", 40.0, "swe", "swe-0", 0.2, 600.0, 300.0),
            ("recent_k", 20.0, "swe", "swe-0", 0.25, 300.0, 200.0),
        ]
    ]
    rows = write_report(tmp_path, tau + swe, runs, records_name="records.jsonl.gz", title="Policies")
    none, recent = rows
    assert (none.trajectories, none.prefill_computed, none.peak_kv_usage) == (2, 600, 0.5)
    assert none.steps_per_min == pytest.approx(3 / 1.0)  # 3 answered in 60 s
    assert (recent.prefill_computed, recent.peak_kv_usage) == (200, 0.25)
    assert read_records(tmp_path / "records.jsonl.gz") == tau + swe
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# Policies") and "## tau-bench" in report and "## mini-swe" in report
    tau = table(report, below="## tau-bench")["none"]
    assert cells(tau, "trajectories", "requests answered", "beyond window") == {
        "trajectories": "1",
        "requests answered": "2",
        "beyond window": "0",
    }
    assert tau["prefill computed"] == "300"  # tau-0's counters alone
    assert (tmp_path / "context_per_turn_swe.png").read_bytes()[:4] == b"\x89PNG"
    assert "cost_vs_evidence_tau.png" in report and not (tmp_path / "cost_vs_evidence.png").exists()


def test_over_recency_reads_zero_for_recent_k_on_the_same_requests(tmp_path):
    """Records of recent_k (k = 2) made with the per-step functions on a real
    mini-swe trajectory sit on the frontier the report computes (over recency
    0); a policy sending the same characters but keeping every needed value
    sits above it by the evidence recency lost."""
    trajectory = load_trajectories(kind="swe")[0]
    kind = trajectory_kind(trajectory)
    messages = trajectory["messages"]
    records = []
    for step, (i, history) in enumerate(agent_requests(messages)):
        if step == 20:
            break
        needed = needed_values(history, messages[i], kind)
        context = recent_k_context(history, 2)
        kept = round(availability(needed, evidence_messages(context, history, kind)) * len(needed)) if needed else 0
        chars = (context_chars(context), context_chars(history))
        records.append(
            rec("recent_k", str(trajectory["id"]), step, 100, needed=len(needed), available=kept, chars=chars)
        )
        records.append(
            rec("oracle", str(trajectory["id"]), step, 100, needed=len(needed), available=len(needed), chars=chars)
        )
    runs = [RunSummary(policy=p, trajectories=1, requests=20, elapsed_s=10.0) for p in ("recent_k", "oracle")]
    recent, oracle = write_report(tmp_path, records, runs, trajectories=[trajectory])
    assert recent.over_recency == pytest.approx(0.0, abs=1e-9)
    assert recent.evidence_availability < 1.0
    assert oracle.over_recency == pytest.approx(1.0 - recent.evidence_availability)
    assert table(markdown_table([recent]))["recent_k"]["over recency"] == "+0.0 pt"
    assert (tmp_path / "evidence_vs_chars.png").read_bytes()[:4] == b"\x89PNG"
    assert "evidence_vs_chars.png" in (tmp_path / "report.md").read_text()
    assert write_report(tmp_path / "no-trajectories", records, runs)[0].over_recency is None


def test_a_request_beyond_the_window_keeps_no_evidence():
    records = [
        rec("none", "A", 0, 100, needed=4, available=4, chars=(100, 100)),
        msgspec.structs.replace(rec("none", "A", 1, 9000, status="beyond_window"), needed=4),
    ]
    (row,) = summarize(records, [RunSummary(policy="none", trajectories=1, requests=2, elapsed_s=6.0)])
    assert row.evidence_availability == pytest.approx(4 / 8)
    assert row.chars_share == pytest.approx(1.0)  # of the answered request


def test_cache_hits_and_recall_changes():
    def step(i, recalled, cached):
        return msgspec.structs.replace(
            rec("pamer", "A", i, 100),
            cached_tokens=cached,
            pamer={"recalled": recalled} if recalled != "-" else {},
        )

    records = [
        step(0, "-", 0),
        step(1, [3], 50),
        step(2, [3], 80),
        step(3, [4, 3], 10),
        step(4, "-", None),
        step(5, [4, 3], 90),
    ]
    (row,) = summarize(records, [RunSummary(policy="pamer", trajectories=1, requests=6, elapsed_s=6.0)])
    assert row.recalls == 3 and row.recall_changes == pytest.approx(1 / 3)  # [3] -> [3] -> [4, 3] -> [4, 3]
    assert row.cache_hits == pytest.approx((0 + 50 + 80 + 10 + 90) / 500)  # step 4 reported none


def test_duplicate_ids_are_replayed_and_measured_apart():
    """Several runs of one task share an id in real traces: the frontier of a
    replay covers exactly the runs replayed, not every run of that id."""
    from vllm_pamer.replay.client import plan_replay
    from vllm_pamer.replay.report import replayed_frontier

    rerun = {**SWE, "messages": SWE["messages"] + SWE["messages"][2:6]}  # same id, another run
    plans = plan_replay([SWE, rerun], max_steps=2)
    assert plans[0].trajectory_id == plans[1].trajectory_id and plans[0].key != plans[1].key
    records = [
        StepRecord(
            policy="none",
            trajectory_id=p.trajectory_id,
            trajectory_key=p.key,
            session_id="s",
            step=s.step,
            message_index=s.message_index,
            status="ok",
            latency_s=0.1,
        )
        for p in plans[:1]
        for s in p.steps
    ]
    (only_first,) = replayed_frontier(records, [SWE, rerun])[:1]
    assert only_first == recency_frontier([SWE], ks=(1,), max_steps=2)[0]
