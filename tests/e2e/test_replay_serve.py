"""End to end: ``vllm-pamer replay`` of a short real tau-bench trajectory with
``none`` and ``recent_k`` against the session's shared server (tests/e2e/conftest.py)."""

from __future__ import annotations

import json

import pytest

from vllm_pamer.replay.cli import main as replay_main
from vllm_pamer.replay.evidence import recency_frontier
from vllm_pamer.replay.records import read_records
from vllm_pamer.trajectories import load_trajectories

pytestmark = pytest.mark.e2e

TRAJECTORY = "airline-task4-trial1"  # 16 messages, 7 requests: the shortest shipped one


@pytest.fixture(scope="module")
def replayed(compress_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    trajectory = {t["id"]: t for t in load_trajectories(kind="tau")}[TRAJECTORY]
    data = root / "one.jsonl"
    data.write_text(json.dumps(trajectory) + "\n")
    out = root / "report"
    replay_main(
        [
            "--url",
            compress_server.base_url,
            "--data",
            str(data),
            "--policies",
            "none,recent_k",
            "--max-tokens",
            "16",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    rows = {row["policy"]: row for row in json.loads((out / "summary.json").read_text())}
    return out, rows, read_records(out / "records.jsonl")


def test_report_fields_are_filled(replayed):
    out, rows, records = replayed
    assert list(rows) == ["none", "recent_k"]
    for row in rows.values():
        assert row["trajectories"] == 1 and row["answered"] == row["requests"] == 7
        assert row["beyond_window"] == 0 and row["errors"] == 0
        for field in ("tokens_per_trajectory", "mean_peak_context", "prefill_computed", "steps_per_min"):
            assert row[field] is not None and row[field] > 0, (row["policy"], field)
        assert row["peak_kv_usage"] is not None  # sampled; may read 0 between two requests
        assert row["preemptions"] is not None  # vLLM exports the counter (0 on an unbound KV cache)
        assert 0 < row["chars_share"] <= 1
    assert rows["none"]["chars_share"] == pytest.approx(1.0)
    assert rows["recent_k"]["chars_share"] < 1
    assert rows["recent_k"]["agree_tool"] is not None and 0 <= rows["recent_k"]["agree_args"] <= 1
    assert (out / "context_per_turn.png").stat().st_size > 0 and "| recent_k |" in (out / "report.md").read_text()
    # the server's recent_k sends what the report's recency frontier assumes (prefix + last 2 blocks)
    trajectory = {t["id"]: t for t in load_trajectories(kind="tau")}[TRAJECTORY]
    (recent_2,) = recency_frontier([trajectory], ks=(2,))
    assert rows["recent_k"]["chars_share"] == pytest.approx(recent_2.chars_share)
    for r in records:
        assert r.pamer["captured"] is True and r.pamer["policy"] == r.policy and r.session_id.startswith(r.policy + "-")
        assert r.prompt_tokens_out == r.usage_prompt_tokens and r.latency_s > 0


def test_recent_k_never_sends_more_than_none(replayed):
    _, rows, records = replayed
    none = {r.step: r.prompt_tokens_out for r in records if r.policy == "none"}
    recent = {r.step: r.prompt_tokens_out for r in records if r.policy == "recent_k"}
    assert none.keys() == recent.keys()
    assert all(recent[s] <= none[s] for s in none)
    assert any(recent[s] < none[s] for s in none)  # later steps drop old blocks
    assert rows["recent_k"]["mean_peak_context"] < rows["none"]["mean_peak_context"]


def test_a_streamed_replay_reads_answers_and_times_the_first_token(replayed, compress_server, tmp_path):
    """``--stream``: the same prompts as the plain replay, each answer folded
    back from its chunks (text or a call, its usage, the plugin's report),
    and the first token before the whole answer."""
    _, _, plain = replayed
    data = tmp_path / "one.jsonl"
    trajectory = {t["id"]: t for t in load_trajectories(kind="tau")}[TRAJECTORY]
    data.write_text(json.dumps(trajectory) + "\n")
    out = tmp_path / "streamed"
    argv = ["--url", compress_server.base_url, "--data", str(data), "--policies", "recent_k", "--max-tokens", "16"]
    replay_main([*argv, "--stream", "--out", str(out), "--no-progress"])
    streamed = read_records(out / "records.jsonl")
    expected = {r.step: r for r in plain if r.policy == "recent_k"}
    assert len(streamed) == len(expected) == 7
    for r in streamed:
        assert r.status == "ok" and r.pamer["captured"] is True and r.pamer["policy"] == "recent_k"
        assert r.usage_prompt_tokens == expected[r.step].usage_prompt_tokens
        assert (r.chars_sent, r.readable) == (expected[r.step].chars_sent, expected[r.step].readable)  # echo kept
        assert 0 < r.usage_completion_tokens <= 16 and (r.action_text or r.action_tool)
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s
    assert "ttft p95 s" in (out / "report.md").read_text()
