"""The report's latency table (``replay/latency.py``), on records with known latencies."""

from __future__ import annotations

from tests.support.markdown import table
from vllm_pamer.replay.latency import latency_notes, latency_table
from vllm_pamer.replay.records import StepRecord


def rec(policy: str, step: int, latency: float, action: str = "none", status: str = "ok", schedule=None) -> StepRecord:
    return StepRecord(
        policy=policy,
        trajectory_id="t",
        session_id=f"{policy}-t",
        step=step,
        message_index=2 * step + 2,
        status=status,
        latency_s=latency,
        pamer={"action": action, "schedule": schedule},
    )


def test_compacting_requests_are_read_apart_from_the_others():
    records = [rec("pamer", i, 1.0) for i in range(19)] + [rec("pamer", 19, 30.0, "compressed")]
    records += [rec("recent_k", i, 2.0) for i in range(10)] + [rec("recent_k", 10, 99.0, status="error")]
    cells = table(latency_table(records))
    assert cells["pamer"]["answered"] == "20" and cells["pamer"]["compacting"] == "1"
    assert cells["pamer"]["compacting max s"] == "30.0" and cells["pamer"]["others p95 s"] == "1.0"
    assert cells["recent_k"]["answered"] == "10" and cells["recent_k"]["max s"] == "2.0"  # the error is not answered
    assert latency_table([]) == ""


def test_a_memory_written_ahead_is_no_wait():
    inline = {"memory_seconds": 12.5, "memory_ahead": False}
    ahead = {"memory_seconds": 9.0, "memory_ahead": True}
    records = [
        rec("pamer", 0, 14.0, "compressed", schedule=inline),
        rec("pamer", 1, 14.0, "compressed", schedule=inline),
    ]
    records += [rec("pamer_ahead", 0, 1.0, "compressed", schedule=ahead), rec("pamer_ahead", 1, 1.0)]
    records += [rec("sam", 0, 5.0, "compressed")]  # no schedule report: it waited, for how long is not known
    cells = table(latency_table(records))
    assert (cells["pamer"]["waited"], cells["pamer"]["waited s"], cells["pamer"]["waited max s"]) == (
        "2",
        "25.0",
        "12.5",
    )
    assert (cells["pamer_ahead"]["waited"], cells["pamer_ahead"]["waited s"]) == ("0", "-")
    assert (cells["sam"]["waited"], cells["sam"]["waited s"]) == ("1", "-")


def test_first_token_columns_and_note_only_where_the_replay_streamed():
    assert "ttft" not in latency_table([rec("pamer", 0, 1.0)])
    assert "first token" not in latency_notes([rec("pamer", 0, 1.0)])
    records = [rec("pamer", i, 2.0) for i in range(3)] + [rec("recent_k", 0, 1.0)]
    for i, r in enumerate(records[:3]):
        r.ttft_s = 0.5 * (i + 1)
    cells = table(latency_table(records))
    assert (cells["pamer"]["ttft p50 s"], cells["pamer"]["ttft max s"]) == ("1.00", "1.50")
    assert cells["recent_k"]["ttft p50 s"] == "-"  # none of its answers streamed a token
    assert "first token" in latency_notes(records)
