"""Hindsight labels (``training/hindsight.py``): compacting now against at the
next decision point, on hand-made trajectories, and the annotate command."""

from __future__ import annotations

import json

import pytest

from tests.support.messages import call, result, user
from vllm_pamer.training.annotate import AnnotatorSettings, annotate_trajectory, annotator_definition, char_counter
from vllm_pamer.training.cli import annotate_main
from vllm_pamer.training.hindsight import HindsightAnnotator

FILLER = "lorem ipsum dolor sit amet " * 200  # > 1024 tokens by chars // 4: past the gate
SYSTEM = {"role": "system", "content": "You are an airline agent."}


def steps(*uses):
    """P, then four old steps (the first result holds XAZ3C0 and Q7RT2P),
    then one step per entry of ``uses``: a call with those values."""
    messages = [SYSTEM, user("Help me with my trip.")]
    messages += [call("c0", "lookup", q="trip"), result("c0", "reservations XAZ3C0 and Q7RT2P " + FILLER)]
    for n in range(1, 4):
        messages += [call(f"c{n}", "think", thought=f"step {n}"), result(f"c{n}", FILLER if n == 1 else "ok")]
    for n, values in enumerate(uses, start=4):
        messages += [call(f"c{n}", "get_reservation_details", reservation_id=" ".join(values)), result(f"c{n}", "ok")]
    return {"id": "t", "source": "hand", "messages": messages}


def label(trajectory, annotator_name="hindsight"):
    """The compression label at the first decision point after the old steps (message index 10)."""
    annotator = HindsightAnnotator(AnnotatorSettings(), char_counter, budget=400)
    points = (
        annotator.annotate(trajectory)
        if annotator_name == "hindsight"
        else annotate_trajectory(trajectory, char_counter)
    )
    return next(p for p in points if p.message_index == 10)


def test_a_value_the_next_action_needs_says_wait_one_step():
    """The next action uses a value only the archived steps hold; the ones
    after it use nothing old: compacting one step later loses nothing."""
    point = label(steps(["XAZ3C0"], [], []))
    assert (point.compression, point.compression_values, point.annotator) == (0, ["XAZ3C0"], "hindsight")
    assert label(steps(["XAZ3C0"], [], []), "reference").compression == 0


def test_a_value_used_later_is_lost_either_way_so_compact_now():
    """Only the action after next uses an old value: a compaction now or at
    the next point loses it alike, so the tie compacts now; the reference
    rule, which asks whether anything old is used, says keep."""
    point = label(steps([], ["Q7RT2P"], []))
    assert (point.compression, point.compression_values) == (1, ["Q7RT2P"])
    assert label(steps([], ["Q7RT2P"], []), "reference").compression == 0


def test_nothing_old_used_compacts_now_and_recall_is_the_reference_rules():
    trajectory = steps([], [], [])
    assert label(trajectory).compression == 1
    ours, reference = (
        HindsightAnnotator(AnnotatorSettings(), char_counter).annotate(trajectory),
        annotate_trajectory(trajectory, char_counter),
    )
    assert [(p.recall, p.compression is None) for p in ours] == [(p.recall, p.compression is None) for p in reference]


def test_the_annotate_command_takes_the_annotators_options(tmp_path, capsys):
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps(steps(["XAZ3C0"], [], [])) + "\n")
    out = tmp_path / "labels.jsonl"
    args = ["--data", str(data), "--tokens", "chars", "--out", str(out), "--no-progress", "--annotator", "hindsight"]
    assert annotate_main([*args, "--annotator-options", '{"budget": 400}']) == 0
    assert '"annotator":"hindsight"' in out.read_text()
    with pytest.raises(SystemExit):
        annotate_main([*args, "--annotator-options", '{"budgets": 400}'])
    assert "budgets" in capsys.readouterr().err
    assert "next decision point" in annotator_definition("hindsight") and annotator_definition("nobody") == ""
