"""Runs the Triton kernels on CPU tensors under the Triton interpreter.

Why a subprocess per kernel module. ``@triton.jit`` reads TRITON_INTERPRET
when a kernel is decorated, i.e. when its module is first imported; setting
it in a conftest is too late if anything earlier in the session imported the
kernel modules, and setting it for the whole session would also switch vLLM's
own Triton kernels (and the engine processes the engine tests start, which
inherit the environment) to the interpreter. So each ``interp_*.py`` module
runs in a fresh ``python -m pytest`` with TRITON_INTERPRET=1 set before
anything is imported; its own summary is in the failure message. The modules
also refuse to run (skip) if their kernels did not come out interpreted, and a
skip fails the test here. To run one directly:
``TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/interp_cosine_topk.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


@pytest.mark.parametrize("module", ["interp_five_head_vote.py", "interp_cosine_topk.py"])
def test_triton_kernel_under_interpreter(module):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", str(HERE / module)],
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
