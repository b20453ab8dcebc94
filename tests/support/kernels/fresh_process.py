"""The Triton checks that need a fresh Python process: a kernel module's tests
under the Triton interpreter, and the NVIDIA compile check.

Why a fresh process. ``@triton.jit`` reads TRITON_INTERPRET when a kernel is
decorated, i.e. when its module is first imported; setting it in a conftest is
too late if anything earlier in the session imported the kernel modules, and
setting it for the whole session would also switch vLLM's own Triton kernels
(and the engine processes the engine tests start, which inherit the
environment) to the interpreter. So each ``tests/kernels/interp_<module>.py``
runs in a fresh ``python -m pytest`` with TRITON_INTERPRET=1 set before
anything is imported (its own summary is in the failure message), and the
compile check runs with TRITON_INTERPRET unset. The interpreted modules also
refuse to run (skip) if their kernels did not come out interpreted, and a skip
fails the check here. To run one directly:
``TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/interp_cosine_topk.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
COMPILE_CHECK = Path(__file__).resolve().with_name("compile_check.py")


def run_interpreted(module: Path) -> None:
    """Runs the test module ``module`` under the Triton interpreter; fails
    unless every test in it passed."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", str(module)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary), report
    assert not re.search(r"skipped|failed|error", summary), report


def check_compiles_without_spills(kernel: str, variants: int) -> None:
    """``compile_check.py`` for the variants of ``kernel`` (``five_head_vote``
    or ``cosine_topk``): all ``variants`` of them compile, none spills a register."""
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(COMPILE_CHECK), kernel],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    compiled = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(compiled) == variants, proc.stdout
    for v in compiled:
        assert v["spill_stores"] == 0 and v["spill_loads"] == 0, v
