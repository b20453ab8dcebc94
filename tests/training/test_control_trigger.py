"""``vllm-pamer train-control`` (``training/control_trigger.py``): the control
is fitted on the tuning split's points only, ranks a planted rule, and writes
a file the budget schedule loads."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from vllm_pamer.core.policies.pamer.control_vote import load_control_trigger
from vllm_pamer.training.cli import annotate_main, train_control_main
from vllm_pamer.training.control_trigger import fit_control_trigger, score_table
from vllm_pamer.training.data import load_labels
from vllm_pamer.trajectories import in_split, load_trajectories


def test_a_planted_rule_on_the_request_s_length_is_ranked():
    rng = np.random.default_rng(0)
    features = [
        {"context_tokens": float(c), "kept_tokens": 300.0, "old_tokens": float(c) - 300, "turn": 1.0}
        | {"assistant_turns": float(rng.integers(1, 40)), "last_tool": str(rng.choice(["bash", "think"]))}
        for c in rng.integers(1000, 6000, size=200)
    ]
    labels = np.asarray([int(f["context_tokens"] > 4000) for f in features])
    trigger = fit_control_trigger(features, labels, n_recent=2, trained_on="planted")
    [row] = [r for name, r in score_table(trigger, features, labels, ["s"] * 200).items() if name == "all"]
    assert row["auroc"] > 0.97 and abs(row["fires"] - labels.mean()) < 0.1


def test_the_command_fits_on_tuning_points_only(tmp_path, capsys):
    labels, out = tmp_path / "labels.jsonl", tmp_path / "control.json"
    assert annotate_main(["--tokens", "chars", "--out", str(labels), "--no-progress"]) == 0
    assert train_control_main(["--labels", str(labels), "--out", str(out)]) == 0
    tuning = {str(t["id"]) for t in in_split(load_trajectories(None, "tau") + load_trajectories(None, "swe"), "tuning")}
    gated_tuning = [p for p in load_labels(labels) if p.compression is not None and p.trajectory_id in tuning]
    assert 0 < len(gated_tuning) < sum(p.compression is not None for p in load_labels(labels))
    trigger = load_control_trigger(out)
    assert trigger.trained_on.startswith(f"{len(gated_tuning)} reference compression labels (annotate --tokens chars)")
    printed = capsys.readouterr().out
    assert "evaluation" in printed and "AUROC" in printed


def test_labels_of_another_token_count_or_of_trajectories_not_given_are_refused(tmp_path, capsys):
    labels, out = tmp_path / "labels.jsonl", tmp_path / "control.json"
    assert annotate_main(["--tokens", "chars", "--out", str(labels), "--no-progress"]) == 0
    points = load_labels(labels)
    gated = next(i for i, p in enumerate(points) if p.compression is not None)
    counted_otherwise = [
        msgspec.structs.replace(p, old_tokens=p.old_tokens * 2) if i == gated else p for i, p in enumerate(points)
    ]
    other = tmp_path / "other.jsonl"
    other.write_bytes(b"".join(msgspec.json.encode(p) + b"\n" for p in counted_otherwise))
    stranger = tmp_path / "stranger.jsonl"
    stranger.write_bytes(msgspec.json.encode(msgspec.structs.replace(points[0], trajectory_id="elsewhere")) + b"\n")
    for path, message in ((other, "annotate --tokens chars"), (stranger, "not in --data")):
        with pytest.raises(SystemExit):
            train_control_main(["--labels", str(path), "--out", str(out)])
        assert message in capsys.readouterr().err
    assert not out.exists()
