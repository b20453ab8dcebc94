"""Trajectories (vllm_pamer/trajectories.py): the tuning / evaluation split by task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_pamer.trajectories import SPLIT_FILE, in_split, load_trajectories, make_split, split_of, task_of

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "trajectories"
FILES = [SHARED / "tau_airline.jsonl.gz", SHARED / "mini_swe.jsonl.gz"]


def test_a_task_is_its_trials():
    assert task_of("airline-task14-trial1") == task_of("airline-task14-trial12") == "airline-task14"
    assert task_of("retail-task3-trial0") == "retail-task3"
    assert task_of("django__django-14752") == "django__django-14752"  # a mini-swe instance is its own task
    assert task_of("airline-task14") == "airline-task14"


@pytest.mark.skipif(not all(f.exists() for f in FILES), reason="the shared trajectories are not beside the checkout")
def test_the_shipped_split_is_the_one_make_split_makes_of_the_shared_trajectories():
    trajectories = [t for f in FILES for t in load_trajectories(f)]
    assert json.loads(SPLIT_FILE.read_text())["tuning"] == make_split(trajectories)
    for source in {t["source"] for t in trajectories}:
        tasks = {task_of(t["id"]) for t in trajectories if t["source"] == source}
        tuning = {task_of(t["id"]) for t in trajectories if t["source"] == source and split_of(t) == "tuning"}
        assert abs(len(tuning) - len(tasks) / 3) <= 0.5  # a third of each source's tasks
    by_task: dict[str, set[str]] = {}
    for t in trajectories:
        by_task.setdefault(task_of(t["id"]), set()).add(split_of(t))
    assert all(len(splits) == 1 for splits in by_task.values())  # every trial of a task on one side


def test_make_split_depends_on_the_tasks_only_and_a_new_task_is_evaluation():
    trials = [{"source": "s", "id": f"airline-task{i}-trial{j}"} for i in range(9) for j in range(4)]
    tuning = make_split(trials)
    assert len(tuning) == 3 and make_split(list(reversed(trials))) == tuning
    assert split_of({"id": "airline-task999-trial0"}) == "evaluation"
    mixed = [{"id": tuning_task} for tuning_task in json.loads(SPLIT_FILE.read_text())["tuning"][:2]] + [{"id": "x"}]
    assert [t["id"] for t in in_split(mixed, "evaluation")] == ["x"]
    assert len(in_split(mixed, "tuning")) == 2 and len(in_split(mixed, None)) == 3
