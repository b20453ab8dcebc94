"""The adapters' touch points (``adapters/vllm_from_0_32/touch_points.py``) hold in
the installed vLLM's source, and in vLLM 0.33's, read from its wheel (GPU
only, so never installed here): downloaded once into the cache with
``pip download --no-deps``; without a network the 0.33 check is skipped,
saying so."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vllm_pamer.adapters import ADAPTERS
from vllm_pamer.adapters.vllm_from_0_32.touch_points import TOUCH_POINTS, TouchPoint

WHEEL_SERIES = {"0.33": "0.33.0"}
"""Series served by an adapter but not installable here: the wheel read."""


def _names(node: ast.AST) -> set[str]:
    """Every identifier and string constant in ``node``."""
    found: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            found.add(child.attr)
        elif isinstance(child, ast.arg):
            found.add(child.arg)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(child.name)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            found.add(child.value)
    return found


def _find(tree: ast.Module, qualname: str) -> ast.AST | None:
    node: ast.AST = tree
    for part in [p for p in qualname.split(".") if p]:
        body = getattr(node, "body", [])
        match = [
            n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == part
        ]
        if not match:
            return None
        node = match[0]
    return node


def check(source: str, point: TouchPoint) -> str | None:
    """What is missing for ``point`` in ``source`` (None: it holds)."""
    node = _find(ast.parse(source), point.qualname)
    if node is None:
        return f"{point.path}: no {point.qualname}"
    missing = sorted(set(point.names) - _names(node))
    return f"{point.path}: {point.qualname or 'module'} lacks {', '.join(missing)}" if missing else None


def installed_sources():
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    return lambda path: (root / path).read_text()


def wheel_sources(version: str):
    cache = Path(os.environ.get("PAMER_CACHE") or Path.home() / ".cache" / "vllm-pamer") / "wheels"
    wheels = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            f"vllm=={version}",
            "-d",
            str(cache),
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        wheels = sorted(cache.glob(f"vllm-{version}-*.whl"))
        if result.returncode or not wheels:
            pytest.skip(f"vLLM {version}'s wheel could not be downloaded: {result.stderr.strip()[-300:]}")
    archive = zipfile.ZipFile(wheels[-1])
    return lambda path: archive.read(f"vllm/{path}").decode()


def _problems(read) -> list[str]:
    problems = []
    for point in TOUCH_POINTS:
        try:
            problem = check(read(point.path), point)
        except (FileNotFoundError, KeyError):
            problem = f"{point.path}: no such file"
        if problem:
            problems.append(problem)
    return problems


def test_the_checker_finds_what_is_missing():
    source = "class A:\n    def f(self, x):\n        self.y = x.compute_logits()\n"
    assert check(source, TouchPoint("a.py", "A.f", ("x", "y", "compute_logits"))) is None
    assert "lacks z" in check(source, TouchPoint("a.py", "A.f", ("x", "z")))
    assert "no A.g" in check(source, TouchPoint("a.py", "A.g"))


def test_touch_points_hold_in_the_installed_vllm():
    assert _problems(installed_sources()) == []


@pytest.mark.network
@pytest.mark.parametrize("series", sorted(WHEEL_SERIES))
def test_touch_points_hold_in_a_served_series_wheel(series):
    assert ADAPTERS[series] == "vllm_from_0_32"  # the package whose touch points these are
    assert _problems(wheel_sources(WHEEL_SERIES[series])) == []
