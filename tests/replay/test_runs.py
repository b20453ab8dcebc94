"""A resumable replay run over sittings (``replay/runs.py``): groups, units in
one file, the settings check, a sitting's steps; no server."""

from __future__ import annotations

import json

import pytest

from tests.support.replay import plans, unit
from vllm_pamer.replay import runs
from vllm_pamer.replay.client import ReplaySettings
from vllm_pamer.replay.runs import GroupedRun, UnitStore


def test_groups_interleave_kinds_so_any_prefix_holds_both():
    groups = runs.make_groups(plans("tau", 9), plans("swe", 3), 4, 2)
    assert [name for name, _ in groups] == ["swe-000", "tau-000", "swe-001", "tau-001", "tau-002"]
    assert [[p.trajectory_id for p in group] for _, group in groups] == [
        ["swe0", "swe1"],
        ["tau0", "tau1", "tau2", "tau3"],
        ["swe2"],
        ["tau4", "tau5", "tau6", "tau7"],
        ["tau8"],
    ]
    assert [name for name, _ in runs.make_groups([], plans("swe", 3), 4, 2)] == ["swe-000", "swe-001"]


def test_run_command_drops_the_sittings_flags(tmp_path):
    out = str(tmp_path / "benchmarks" / "results" / "x")
    command = runs.run_command(
        ".venv/bin/python -m benchmarks.policies",
        ["--tau", "0", "--stop-after-min", "90", "--rerun", "pamer", "--report-only", "--out", out],
        tmp_path,
    )
    assert command == ".venv/bin/python -m benchmarks.policies --tau 0 --out benchmarks/results/x"


def test_settings_are_kept_and_a_resume_with_others_is_refused(tmp_path):
    settings = {"tau": 0, "swe_group_size": None, "policies": "none,pamer"}
    commits = runs.check_settings(tmp_path, settings, "abc1234")
    assert commits == ["abc1234"]
    assert json.loads((tmp_path / "settings.json").read_text())["commits"] == commits
    assert runs.check_settings(tmp_path, settings, "abc1234") == commits  # same commit listed once
    with pytest.raises(SystemExit, match="swe_group_size"):
        runs.check_settings(tmp_path, {**settings, "swe_group_size": 2}, "abc1234")
    log = "(EngineCore) INFO [kv_cache_utils.py:2327] CPU KV cache size: 169,216 tokens, Maximum concurrency ..."
    assert runs.note_kv_budget(tmp_path, log) == 169_216 and runs.kv_budget(tmp_path) == "169,216"
    assert runs.check_settings(tmp_path, settings, "abc1234") == commits  # the reported budget is not an option
    assert runs.kv_budget(tmp_path) == "169,216"  # and a resume keeps it
    assert runs.note_kv_budget(tmp_path, log) == 169_216  # a sitting with the same budget goes on
    with pytest.raises(SystemExit, match=r"25,216 tokens.*169,216"):  # one with another is refused
        runs.note_kv_budget(tmp_path, log.replace("169,216", "25,216"))
    assert runs.kv_budget(tmp_path) == "169,216"
    with pytest.raises(SystemExit, match="extra"):
        runs.check_settings(tmp_path, {**settings, "extra": 3}, "abc1234")  # a new option set differently
    assert runs.check_settings(tmp_path, {**settings, "extra": None}, "abc1234") == commits  # a new option left unset


def test_policies_appended_to_a_run_resume_it_and_are_noted(tmp_path):
    settings = {"tau": 0, "policies": "none,pamer"}
    runs.check_settings(tmp_path, settings, "abc1234")
    for reordered in ("pamer,none,sam", "none,sam", "none"):  # a policy moved, replaced or left out
        with pytest.raises(SystemExit, match="policies"):
            runs.check_settings(tmp_path, {**settings, "policies": reordered}, "abc1234")
    with pytest.raises(SystemExit, match="tau"):  # an appended policy does not excuse another change
        runs.check_settings(tmp_path, {"tau": 1, "policies": "none,pamer,sam"}, "def5678")
    appended = {**settings, "policies": "none,pamer,sam"}
    assert runs.check_settings(tmp_path, appended, "def5678", running=False) == ["abc1234"]  # as a sitting begins
    assert runs.check_settings(tmp_path, appended, "def5678") == ["abc1234", "def5678"]
    assert runs.reruns(tmp_path) == " sam added at def5678."
    runs.check_settings(tmp_path, {**settings, "policies": "none,pamer,sam"}, "def5678")  # the resume after it
    assert runs.reruns(tmp_path) == " sam added at def5678."


def test_a_rerun_drops_the_units_of_changed_policies_and_says_so(tmp_path):
    runs.check_settings(tmp_path, {"tau": 0}, "abc1234")
    store = UnitStore(tmp_path)
    for name in ("none", "pamer", "pamer_tight"):
        for group in ("tau-000", "tau-001"):
            store.add(unit(name, group, "tau0", "tau"))
    assert store.drop(["pamer", "pamer_tight"]) == 4
    runs.note_rerun(tmp_path, ["pamer", "pamer_tight"], "def5678", 4)
    again = UnitStore(tmp_path)  # read back from the rewritten file
    assert again.complete(["tau-000", "tau-001"], ["none"]) == ["tau-000", "tau-001"]
    assert not again.has("tau-000", "pamer") and not again.has("tau-001", "pamer_tight")
    assert [(u.run.group, u.run.policy) for u in again.units()] == [("tau-000", "none"), ("tau-001", "none")]
    assert runs.check_settings(tmp_path, {"tau": 0}, "def5678") == ["abc1234", "def5678"]  # a resume keeps it
    saved = json.loads((tmp_path / "settings.json").read_text())
    assert saved["reruns"] == [{"policies": ["pamer", "pamer_tight"], "commit": "def5678", "units_dropped": 4}]
    assert runs.reruns(tmp_path) == " pamer, pamer_tight run again from def5678 (4 units dropped)."


def test_a_unit_torn_by_a_killed_sitting_is_cut_off_and_runs_again(tmp_path):
    store = UnitStore(tmp_path)
    first, second = unit("none", "tau-000", "tau0", "tau"), unit("pamer", "tau-000", "tau0", "tau")
    store.add(first)
    store.add(second)
    path = tmp_path / runs.UNITS_FILE
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # the last write never finished
    reader = UnitStore(tmp_path, repair=False)  # a report or a comparison: reads, never cuts
    assert reader.has("tau-000", "none") and not reader.has("tau-000", "pamer")
    assert path.stat().st_size == len(whole) - 7
    reopened = UnitStore(tmp_path)
    assert reopened.has("tau-000", "none") and not reopened.has("tau-000", "pamer")
    assert path.stat().st_size < len(whole) - 7  # the torn member is gone
    reopened.add(second)  # the resumed sitting runs it again
    assert UnitStore(tmp_path).load(["tau-000"], ["none", "pamer"]) == [first, second]


class FakeServer:
    """Stands in for the run's own server: says when it was waited for and stopped."""

    base_url = "http://127.0.0.1:9"

    def __init__(self, log_path, events):
        self.log_path, self.events = log_path, events

    def wait_ready(self, timeout):
        self.events.append("ready")

    def stop(self):
        self.events.append("stop")


def test_a_sitting_refuses_other_settings_before_it_starts_a_server(tmp_path):
    runs.check_settings(tmp_path, {"tau": 0}, "abc1234")
    started = []
    run = GroupedRun(tmp_path, [("tau-000", plans("tau", 1))], ["none"], {"tau": 1}, "def5678")
    with pytest.raises(runs.SettingsMismatch, match=r"other settings \(tau\)"):
        runs.sit(run, ReplaySettings(), lambda: started.append("server"))
    assert not started


def test_a_sitting_runs_what_is_not_saved_on_its_own_server_and_stops_it(tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    log.write_text("(EngineCore) INFO CPU KV cache size: 25,216 tokens, Maximum concurrency ...")
    out = tmp_path / "run"
    store = UnitStore(out)
    store.add(unit("none", "tau-000", "tau0", "tau"))
    store.add(unit("pamer", "tau-000", "tau0", "tau"))
    ran = []

    async def run_units(settings, groups, policies, store, stop_after_s):
        ran.append((settings.url, stop_after_s, store.has("tau-000", "none"), store.has("tau-000", "pamer")))
        return 3

    monkeypatch.setattr(runs, "run_units", run_units)
    events = []
    groups = [("tau-000", plans("tau", 1)), ("tau-001", plans("tau", 1))]
    run = GroupedRun(out, groups, ["none", "pamer"], {"tau": 2}, "abc1234")
    commits = runs.sit(run, ReplaySettings(url="http://elsewhere"), lambda: FakeServer(log, events), 2.0, ["pamer"])
    assert events == ["ready", "stop"]
    assert ran == [("http://127.0.0.1:9", 120.0, True, False)]  # on its server, pamer's unit dropped first
    assert commits == ["abc1234"]
    saved = json.loads((out / "settings.json").read_text())
    assert saved["kv_cache_tokens"] == 25_216
    assert saved["reruns"] == [{"policies": ["pamer"], "commit": "abc1234", "units_dropped": 1}]


def test_a_failed_sitting_stops_its_server_and_report_only_starts_none(tmp_path, monkeypatch):
    async def run_units(*args):
        raise RuntimeError("engine died")

    monkeypatch.setattr(runs, "run_units", run_units)
    events = []
    log = tmp_path / "server.log"
    log.write_text("a server that reports no KV budget")
    run = GroupedRun(tmp_path, [("tau-000", plans("tau", 1))], ["none"], {"tau": 1}, "abc1234")
    with pytest.raises(RuntimeError, match="engine died"):
        runs.sit(run, ReplaySettings(), lambda: FakeServer(log, events))
    assert events == ["ready", "stop"]
    assert runs.sit(run, ReplaySettings(), lambda: events.append("again"), report_only=True) == ["abc1234"]
    assert events == ["ready", "stop"]
