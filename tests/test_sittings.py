"""The bookkeeping of a benchmark spread over sittings (groups, resumable
units in one file, the settings check, the report over finished groups) and
the interleaved A/B rounds; no server."""

from __future__ import annotations

import json

import pytest

from vllm_pamer.replay import sittings
from vllm_pamer.replay.ab import abba, interleaved_rounds
from vllm_pamer.replay.client import TrajectoryPlan
from vllm_pamer.replay.records import RunSummary, StepRecord
from vllm_pamer.replay.sittings import Unit, UnitStore


def plans(kind: str, n: int) -> list[TrajectoryPlan]:
    return [TrajectoryPlan(f"{kind}{i}", kind, None, []) for i in range(n)]


def test_groups_interleave_kinds_so_any_prefix_holds_both():
    groups = sittings.make_groups(plans("tau", 9), plans("swe", 3), 4, 2)
    assert [name for name, _ in groups] == ["swe-000", "tau-000", "swe-001", "tau-001", "tau-002"]
    assert [[p.trajectory_id for p in group] for _, group in groups] == [
        ["swe0", "swe1"],
        ["tau0", "tau1", "tau2", "tau3"],
        ["swe2"],
        ["tau4", "tau5", "tau6", "tau7"],
        ["tau8"],
    ]
    assert [name for name, _ in sittings.make_groups([], plans("swe", 3), 4, 2)] == ["swe-000", "swe-001"]


def test_run_command_drops_the_sittings_flags(tmp_path):
    out = str(tmp_path / "benchmarks" / "results" / "x")
    command = sittings.run_command(
        "benchmarks.policies",
        ["--tau", "0", "--stop-after-min", "90", "--rerun", "pamer", "--report-only", "--out", out],
        tmp_path,
    )
    assert command == ".venv/bin/python -m benchmarks.policies --tau 0 --out benchmarks/results/x"


def test_settings_are_kept_and_a_resume_with_others_is_refused(tmp_path):
    settings = {"tau": 0, "swe_group_size": None, "policies": "none,pamer"}
    commits = sittings.check_settings(tmp_path, settings, "abc1234")
    assert commits == ["abc1234"]
    assert json.loads((tmp_path / "settings.json").read_text())["commits"] == commits
    assert sittings.check_settings(tmp_path, settings, "abc1234") == commits  # same commit listed once
    with pytest.raises(SystemExit, match="swe_group_size"):
        sittings.check_settings(tmp_path, {**settings, "swe_group_size": 2}, "abc1234")
    log = "(EngineCore) INFO [kv_cache_utils.py:2327] CPU KV cache size: 169,216 tokens, Maximum concurrency ..."
    assert sittings.note_kv_budget(tmp_path, log) == 169_216 and sittings.kv_budget(tmp_path) == "169,216"
    assert sittings.check_settings(tmp_path, settings, "abc1234") == commits  # the reported budget is not an option
    assert sittings.kv_budget(tmp_path) == "169,216"  # and a resume keeps it
    assert sittings.note_kv_budget(tmp_path, log) == 169_216  # a sitting with the same budget goes on
    with pytest.raises(SystemExit, match=r"25,216 tokens.*169,216"):  # one with another is refused
        sittings.note_kv_budget(tmp_path, log.replace("169,216", "25,216"))
    assert sittings.kv_budget(tmp_path) == "169,216"
    with pytest.raises(SystemExit, match="extra"):
        sittings.check_settings(tmp_path, {**settings, "extra": 3}, "abc1234")  # a new option set differently
    assert (
        sittings.check_settings(tmp_path, {**settings, "extra": None}, "abc1234") == commits
    )  # a new option left unset


def unit(policy: str, group: str, trajectory: str, kind: str, elapsed_s: float = 6.0) -> Unit:
    record = StepRecord(
        policy=policy,
        trajectory_id=trajectory,
        kind=kind,
        session_id=f"{policy}-{trajectory}",
        step=0,
        message_index=2,
        status="ok",
        latency_s=1.0,
        prompt_tokens_out=100,
        usage_prompt_tokens=100,
        usage_completion_tokens=10,
    )
    run = RunSummary(
        policy=policy,
        trajectories=1,
        requests=1,
        elapsed_s=elapsed_s,
        kind=kind,
        group=group,
        metric_deltas={"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 40.0},
    )
    return Unit(run, [record])


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

    def preface(finished, kinds):
        return (
            f"{finished} of {len(groups)} groups: {kinds['tau']} tau-bench and {kinds['swe']} mini-swe trajectories\n"
        )

    sittings.write_finished_report(tmp_path, groups, policy_names, preface, trajectories=[])
    text = (tmp_path / "report.md").read_text()
    assert "2 of 3 groups: 1 tau-bench and 1 mini-swe trajectories" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(row["policy"], row["trajectories"], row["prefill_computed"]) for row in summary] == [
        ("none", 2, 120),
        ("pamer", 2, 120),
    ]
    assert "## tau-bench" in text and "## mini-swe" in text
    assert not (tmp_path / "records.jsonl").exists()  # the units are the records


def test_a_rerun_drops_the_units_of_changed_policies_and_says_so(tmp_path):
    sittings.check_settings(tmp_path, {"tau": 0}, "abc1234")
    store = UnitStore(tmp_path)
    for name in ("none", "pamer", "pamer_tight"):
        for group in ("tau-000", "tau-001"):
            store.add(unit(name, group, "tau0", "tau"))
    assert store.drop(["pamer", "pamer_tight"]) == 4
    sittings.note_rerun(tmp_path, ["pamer", "pamer_tight"], "def5678", 4)
    again = UnitStore(tmp_path)  # read back from the rewritten file
    assert again.complete(["tau-000", "tau-001"], ["none"]) == ["tau-000", "tau-001"]
    assert not again.has("tau-000", "pamer") and not again.has("tau-001", "pamer_tight")
    assert sittings.check_settings(tmp_path, {"tau": 0}, "def5678") == ["abc1234", "def5678"]  # a resume keeps it
    saved = json.loads((tmp_path / "settings.json").read_text())
    assert saved["reruns"] == [{"policies": ["pamer", "pamer_tight"], "commit": "def5678", "units_dropped": 4}]
    assert sittings.reruns(tmp_path) == " pamer, pamer_tight run again from def5678 (4 units dropped)."


def test_against_another_run_compares_the_groups_both_finished(tmp_path):
    here, there = UnitStore(tmp_path / "bound"), UnitStore(tmp_path / "free")
    groups = [("swe-000", plans("swe", 1)), ("tau-000", plans("tau", 1)), ("tau-001", plans("tau", 1))]
    for group, trajectory, kind in (("swe-000", "swe0", "swe"), ("tau-000", "tau0", "tau"), ("tau-001", "tau1", "tau")):
        for name in ("none", "pamer"):
            here.add(unit(name, group, trajectory, kind, elapsed_s=12.0))
            if group != "tau-001":  # the other run has not reached tau-001
                there.add(unit(name, group, trajectory, kind))
    text = sittings.against_section(here, there, "free", groups, ["none", "pamer"])
    assert "### tau-bench (1 groups, 1 trajectories)" in text and "### mini-swe (1 groups, 1 trajectories)" in text
    # 1 request in 12 s here against 6 s there: 5.00 against 10.00 steps / min
    assert "| none | 100 | - | - | 5.00 | 10.00 | 0.50 | 60 | 60 | - |" in text
    assert sittings.against_section(here, UnitStore(tmp_path / "empty"), "empty", groups, ["none"]) == ""


def test_ab_rounds_alternate_abba():
    assert abba(1) == [0, 1]
    assert abba(3) == [0, 1, 1, 0, 0, 1]  # each side 3 times, a linear drift shared


class FakeServer:
    def __init__(self, side, events):
        self.side, self.events = side, events

    def wait_ready(self, timeout, progress):
        self.events.append(("ready", self.side))

    def stop(self):
        self.events.append(("stop", self.side))


def test_ab_rounds_collect_each_side_and_stop_every_server():
    events, measured = [], iter(range(100))
    results, logs = interleaved_rounds(
        2,
        lambda side, log: FakeServer(side, events),
        lambda side, server: (side, next(measured)),
        lambda side, result: str(result),
        "ab-test-",
    )
    assert results == [[(0, 0), (0, 3)], [(1, 1), (1, 2)]]  # rounds a b b a
    assert events == [(kind, side) for side in (0, 1, 1, 0) for kind in ("ready", "stop")]
    assert sorted(p.name for p in logs.iterdir()) == ["0", "1", "2", "3"]


def test_ab_rounds_stop_the_server_when_a_round_fails():
    events = []

    def measure(side, server):
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        interleaved_rounds(1, lambda side, log: FakeServer(side, events), measure, str, "ab-test-")
    assert events == [("ready", 0), ("stop", 0)]


def test_a_unit_torn_by_a_killed_sitting_is_cut_off_and_runs_again(tmp_path):
    store = UnitStore(tmp_path)
    first, second = unit("none", "tau-000", "tau0", "tau"), unit("pamer", "tau-000", "tau0", "tau")
    store.add(first)
    store.add(second)
    path = tmp_path / sittings.UNITS_FILE
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # the last write never finished
    reopened = UnitStore(tmp_path)
    assert reopened.has("tau-000", "none") and not reopened.has("tau-000", "pamer")
    assert path.stat().st_size < len(whole) - 7  # the torn member is gone
    reopened.add(second)  # the resumed sitting runs it again
    assert UnitStore(tmp_path).load(["tau-000"], ["none", "pamer"]) == [first, second]
