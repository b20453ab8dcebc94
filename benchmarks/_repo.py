"""Where the benchmarks run: this repository (its root, the commit that ran)
and the full trajectory sets beside it (``../shared/data/trajectories``; the
scripts fall back to the shipped samples where they are absent). A shared
helper, not a script."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "trajectories"


def git_commit(root: Path = ROOT) -> str:
    """The checked-out commit (short), which a run's settings.json and report list."""
    try:
        return subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
