"""The Triton kernels compile for NVIDIA GPUs (sm_90, sm_80) without a GPU, at
the tiles the launchers plan, with no register spills: see compile_check.py.
A subprocess, for the same reason as test_triton_interpreter.py: the kernel
modules must be imported with TRITON_INTERPRET unset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_kernels_compile_for_nvidia_without_spills():
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "compile_check.py")],
        cwd=HERE.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    variants = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(variants) >= 7, proc.stdout
    for v in variants:
        assert v["spill_stores"] == 0 and v["spill_loads"] == 0, v
