"""Recorded agent trajectories, how an agent would have replayed them, and
which split of the evaluation each belongs to (``split_of``)."""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

DATA_DIR = Path(__file__).parent / "data" / "trajectories"
SHIPPED = {
    "tau": "tau_airline_sample.jsonl.gz",
    "swe": "mini_swe_sample.jsonl.gz",
}


def load_trajectories(path: str | Path | None = None, kind: str = "tau") -> list[dict[str, Any]]:
    """Trajectories from a ``.jsonl[.gz]`` file, or the shipped sample of ``kind``."""
    if path is None:
        raw = (DATA_DIR / SHIPPED[kind]).read_bytes()
    else:
        raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def load_or_sample(path: str | Path, kind: str) -> list[dict[str, Any]]:
    """The trajectories at ``path`` where that file exists, else the shipped sample of ``kind``."""
    return load_trajectories(path if Path(path).exists() else None, kind=kind)


def trajectory_key(trajectory: Mapping[str, Any]) -> str:
    """A key unique to this trajectory: its id and a digest of its messages
    (real traces repeat ids: several runs of one task share one)."""
    digest = hashlib.sha256(json.dumps(trajectory.get("messages"), sort_keys=True).encode()).hexdigest()[:10]
    return f"{trajectory.get('id', '')}@{digest}"


def agent_requests(messages: list[dict[str, Any]]) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """The requests the agent sent: for each assistant message i, the history
    before it (``messages[:i]``). Yields (i, history)."""
    for i, message in enumerate(messages):
        if message.get("role") == "assistant" and i > 0:
            yield i, messages[:i]


_TRIAL_RE = re.compile(r"^(?P<task>.+)-trial\d+$")
Split = Literal["tuning", "evaluation"]
SPLIT_FILE = Path(__file__).parent / "data" / "splits.json"
"""The tuning tasks, fixed once (``make_split`` over the shared trajectories;
``python -m vllm_pamer.trajectories --make-split PATH ...`` writes it)."""
TUNING_SHARE = 1 / 3
SPLIT_SALT = "vllm-pamer tuning split 2026-12-04"


def task_of(trajectory_id: str) -> str:
    """The task a trajectory solves, the unit every split is made of:
    tau-bench ``airline-task14-trial1`` -> ``airline-task14`` (all trials of a
    task together); any other id (a mini-swe instance) is its own task."""
    match = _TRIAL_RE.match(trajectory_id)
    return match.group("task") if match else trajectory_id


def make_split(trajectories: Iterable[Mapping[str, Any]], share: float = TUNING_SHARE) -> list[str]:
    """The tuning tasks: per source, the ``share`` of its tasks first in the
    order of their salted sha256 (no random state; the rest is evaluation)."""
    by_source: dict[str, set[str]] = {}
    for trajectory in trajectories:
        by_source.setdefault(str(trajectory.get("source", "")), set()).add(task_of(str(trajectory.get("id", ""))))
    tuning: list[str] = []
    for tasks in by_source.values():
        ordered = sorted(tasks, key=lambda t: hashlib.sha256(f"{SPLIT_SALT}:{t}".encode()).hexdigest())
        tuning += ordered[: round(share * len(ordered))]
    return sorted(tuning)


@functools.cache  # read once: split_of runs per row of a training set
def _tuning_tasks() -> frozenset[str]:
    return frozenset(json.loads(SPLIT_FILE.read_text())["tuning"])


def split_of(trajectory: Mapping[str, Any]) -> Split:
    """``tuning`` (defaults are to be chosen, and heads trained, on these) or
    ``evaluation`` (figures are to be reported on these); a task the split
    file does not name is evaluation. The shipped heads predate the split
    (``benchmarks/RESULTS.md`` says on what they were trained)."""
    return "tuning" if task_of(str(trajectory.get("id", ""))) in _tuning_tasks() else "evaluation"


def in_split(trajectories: Iterable[Mapping[str, Any]], split: Split | None) -> list[dict[str, Any]]:
    """The trajectories of ``split`` in their order (None: all)."""
    return [dict(t) for t in trajectories if split is None or split_of(t) == split]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m vllm_pamer.trajectories", description="Write the split file.")
    parser.add_argument("--make-split", nargs="+", metavar="PATH", required=True, help="trajectory files (.jsonl.gz)")
    args = parser.parse_args(argv)
    trajectories = [t for path in args.make_split for t in load_trajectories(path)]
    tuning = make_split(trajectories)
    payload = {"salt": SPLIT_SALT, "share": TUNING_SHARE, "tuning": tuning}
    SPLIT_FILE.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{SPLIT_FILE}: {len(tuning)} tuning tasks of {len({task_of(str(t['id'])) for t in trajectories})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
