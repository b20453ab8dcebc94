"""Recorded agent trajectories and how an agent would have replayed them."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

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
