"""What a policy's inserted text spends its characters on (replay/spending.py):
per request by part, and per policy as shares, on known messages."""

from __future__ import annotations

import pytest

from vllm_pamer.core.policies.pamer.memory import EXCERPT_MARK
from vllm_pamer.core.policies.pamer.record import RECORD_HEADER
from vllm_pamer.replay.records import PolicyRow, StepRecord
from vllm_pamer.replay.spending import INSERTED_PARTS, add_spending, inserted_spending, spending_table

PREFIX = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix the parser."}]
STEP = [{"role": "assistant", "content": "cat a.py"}, {"role": "tool", "content": "def parse(): ..."}]
LAST = [{"role": "assistant", "content": "edit a.py"}, {"role": "tool", "content": "done"}]
HISTORY = PREFIX + STEP + LAST


def test_only_what_the_policy_inserted_is_counted_by_part():
    memory = {"role": "user", "content": f"[memory 1] The goal.\n\n{RECORD_HEADER}\nstep 1:\n  result: def parse()"}
    spent = inserted_spending([*PREFIX, memory, *LAST], HISTORY)  # the prefix and kept raw messages are not
    assert spent["summary"] == len("The goal.\n\n")
    assert spent["results"] == len("  result: def parse()\n")
    assert sum(spent.values()) == len(memory["content"]) + 1
    masked = {"role": "tool", "content": "[tool output removed: 16 chars]"}
    spent = inserted_spending([*PREFIX, STEP[0], masked, *LAST], HISTORY)  # observation masking
    assert spent == {**dict.fromkeys(INSERTED_PARTS, 0), "masked": len(masked["content"]) + 1}
    excerpted = {"role": "tool", "content": f"[tool output removed: 16 chars]{EXCERPT_MARK}def parse(): ..."}
    spent = inserted_spending([*PREFIX, STEP[0], excerpted, *LAST], HISTORY)  # excerpt masking
    assert spent["masked"] == len("[tool output removed: 16 chars]") + 1
    assert spent["results"] == len(EXCERPT_MARK + "def parse(): ...")
    assert sum(inserted_spending(HISTORY, HISTORY).values()) == 0  # the full history inserts nothing


def _record(policy, inserted, status="ok"):
    return StepRecord(
        policy=policy,
        trajectory_id="t",
        session_id="s",
        step=0,
        message_index=2,
        status=status,
        latency_s=1.0,
        inserted=inserted,
    )


def test_a_policy_reports_its_mean_inserted_chars_and_their_shares():
    counts = {"trajectories": 1, "requests": 3, "answered": 2, "beyond_window": 1, "errors": 0}
    rows = [PolicyRow(policy="record_only", **counts), PolicyRow(policy="truncate", **counts)]
    add_spending(
        rows,
        [
            _record("record_only", {"calls": 30, "results": 10}),
            _record("record_only", {"calls": 10, "results": 30, "framing": 20}),
            _record("record_only", {"calls": 999}, status="beyond_window"),  # refused: not counted
            _record("truncate", dict.fromkeys(INSERTED_PARTS, 0)),
        ],
    )
    assert rows[0].inserted_chars == pytest.approx(50)
    assert rows[0].spending is not None
    assert rows[0].spending["calls"] == pytest.approx(0.4) and rows[0].spending["framing"] == pytest.approx(0.2)
    assert rows[1].inserted_chars is None  # nothing inserted: not in the table
    table = spending_table(rows)
    assert "| record_only | 50 | 0.0% | 40.0% |" in table and "truncate" not in table
