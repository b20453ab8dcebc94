"""``vllm-pamer replay``'s options (``replay/cli.py``): what needs what, and a
resumable run's groups, resume check and report from saved units; no server."""

from __future__ import annotations

import json

import pytest

from tests.support.replay import unit
from vllm_pamer.replay.cli import main
from vllm_pamer.replay.runs import UnitStore
from vllm_pamer.trajectories import load_trajectories


@pytest.mark.parametrize(
    ("argv", "needs"),
    [
        (["--report-only"], "need --group-size"),
        (["--stop-after-min", "5"], "need --group-size"),
        (["--against", "elsewhere"], "need --group-size"),
        (["--heads", "h.safetensors", "--group-size", "2"], "need --serve"),
        (["--kv-cache-blocks", "400"], "need --serve"),
        (["--stream", "--likelihood"], "the likelihood pass reads a plain answer"),
        (["--stream", "--policies", "none,sam"], "a streamed SAM is another policy"),
        (["--stream", "--api", "responses"], "--stream reads chat completions"),
    ],
)
def test_options_of_a_resumable_run_or_of_its_own_server_need_theirs(argv, needs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2 and needs in capsys.readouterr().err


@pytest.fixture
def data(tmp_path):
    """Three tau-bench trajectories and one mini-swe, in one file."""
    chosen = load_trajectories(kind="tau")[:3] + load_trajectories(kind="swe")[:1]
    path = tmp_path / "four.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in chosen))
    return path


def test_a_resumable_run_groups_by_kind_refuses_other_settings_and_reports_finished_groups(data, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--data", str(data), "--group-size", "2", "--policies", "none,recent_k", "--no-progress", "--out", str(out)]
    store = UnitStore(out)
    for group, kind in (("swe-000", "swe"), ("tau-000", "tau")):  # tau-001 (the third tau) never ran
        for policy in ("none", "recent_k"):
            store.add(unit(policy, group, f"{kind}0", kind))
    assert main([*argv, "--report-only"]) == 0
    text = (out / "report.md").read_text()
    assert "2 of 3 groups finished by all 2 policies: 2 tau-bench and 1 mini-swe trajectories" in text
    assert "(at most all requests each), 1 sessions at a time, 64 tokens generated per request, KV cache" in text
    assert f"Command: `vllm-pamer replay --data {data} --group-size 2" in text and "--report-only" not in text
    assert json.loads((out / "settings.json").read_text())["group_size"] == 2
    capsys.readouterr()
    with pytest.raises(SystemExit, match=r"other settings \(max_steps\)"):
        main([*argv, "--max-steps", "3", "--report-only"])


def test_a_resumable_run_without_a_server_says_so(data, tmp_path):
    argv = ["--data", str(data), "--group-size", "2", "--no-progress", "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit, match=r"cannot reach http://127\.0\.0\.1:9"):
        main([*argv, "--url", "http://127.0.0.1:9", "--timeout", "5"])
