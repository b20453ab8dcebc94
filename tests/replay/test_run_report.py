"""The report of a resumable run (``replay/run_report.py``): it covers the
groups every policy finished, and compares them against another run."""

from __future__ import annotations

import json

from tests.support.markdown import cells, table
from tests.support.replay import plans, unit
from vllm_pamer.replay import run_report
from vllm_pamer.replay.runs import GroupedRun, UnitStore


def test_units_round_trip_and_the_report_covers_finished_groups_only(tmp_path, capsys):
    groups = [("swe-000", plans("swe", 1)), ("tau-000", plans("tau", 1)), ("tau-001", plans("tau", 1))]
    policy_names = ["none", "pamer"]
    store = UnitStore(tmp_path)
    saved = unit("pamer", "tau-000", "tau0", "tau")
    store.add(saved)
    assert UnitStore(tmp_path).load(["tau-000"], ["pamer"]) == [saved]  # read back from the one file
    for group, trajectory, kind, names in (
        ("swe-000", "swe0", "swe", policy_names),
        ("tau-000", "tau0", "tau", ["none"]),
        ("tau-001", "tau1", "tau", ["pamer"]),
    ):  # tau-001 lacks none
        for name in names:
            store.add(unit(name, group, trajectory, kind))
    assert [p.name for p in tmp_path.iterdir()] == ["units.jsonl.gz"]

    run = GroupedRun(tmp_path, groups, policy_names, {}, "abc1234")
    run_report.write_finished_report(run, ["abc1234"], "(2 requests each)", "replay --here", trajectories=[])
    text = (tmp_path / "report.md").read_text()
    assert "2 of 3 groups finished by all 2 policies: 1 tau-bench and 1 mini-swe trajectories (2 requests each)" in text
    assert "KV cache of unreported tokens. Code: abc1234. Command: `replay --here`" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(row["policy"], row["trajectories"], row["prefill_computed"]) for row in summary] == [
        ("none", 2, 120),
        ("pamer", 2, 120),
    ]
    assert "## tau-bench" in text and "## mini-swe" in text
    assert not (tmp_path / "records.jsonl").exists()  # the units are the records


def test_against_another_run_compares_the_groups_both_finished(tmp_path):
    here, there = UnitStore(tmp_path / "bound"), UnitStore(tmp_path / "free")
    groups = [("swe-000", plans("swe", 1)), ("tau-000", plans("tau", 1)), ("tau-001", plans("tau", 1))]
    for group, trajectory, kind in (("swe-000", "swe0", "swe"), ("tau-000", "tau0", "tau"), ("tau-001", "tau1", "tau")):
        for name in ("none", "pamer"):
            here.add(unit(name, group, trajectory, kind, elapsed_s=12.0))
            if group != "tau-001":  # the other run has not reached tau-001
                there.add(unit(name, group, trajectory, kind))
    text = run_report.against_section(here, there, "free", groups, ["none", "pamer"])
    assert "### tau-bench (1 groups, 1 trajectories)" in text and "### mini-swe (1 groups, 1 trajectories)" in text
    # 1 request in 12 s here against 6 s there: 5.00 against 10.00 steps / min
    for kind in ("### tau-bench", "### mini-swe"):
        none = table(text, below=kind)["none"]
        assert cells(none, "steps / min", "steps / min there", "ratio") == {
            "steps / min": "5.00",
            "steps / min there": "10.00",
            "ratio": "0.50",
        }
        assert cells(none, "mean peak context", "prefill computed", "prefill computed there") == {
            "mean peak context": "100",
            "prefill computed": "60",
            "prefill computed there": "60",
        }
    assert run_report.against_section(here, UnitStore(tmp_path / "empty"), "empty", groups, ["none"]) == ""
