"""Small helpers shared by the Triton launchers (imported only with Triton)."""

from __future__ import annotations

import functools

import torch


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_interpreted(jit_fn) -> bool:
    """True when Triton decorated ``jit_fn`` for the CPU interpreter, which
    happens only if TRITON_INTERPRET=1 was set before the kernel module was
    imported."""
    return type(jit_fn).__name__ == "InterpretedFunction"


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device, interpreted: bool, per_sm: int) -> int:
    """Programs enough for ``per_sm`` resident programs on every SM, so all of
    them stream weights or rows; the interpreter runs programs one by one, so
    there the fewer the better."""
    if interpreted or device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return per_sm * sm_count(index)


def default_precision(device: torch.device, interpreted: bool) -> str:
    """tl.dot input precision for fp32 operands. On NVIDIA "tf32x3": three
    TF32 tensor-core products (hi*hi + hi*lo + lo*hi), within ~1e-6 of fp32
    products, so results match torch's fp32 (TF32 off) while the fp32 heads
    at B = 128 stay bandwidth-bound instead of FMA-bound. Plain fp32 ("ieee")
    under the interpreter and on ROCm, which lacks tf32x3."""
    if interpreted or device.type != "cuda" or torch.version.hip:
        return "ieee"
    return "tf32x3"


def check_device(jit_fn, *tensors: torch.Tensor) -> torch.device:
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type != "cuda" and not is_interpreted(jit_fn):
        raise RuntimeError(
            "Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton "
            "is imported to run CPU tensors under the interpreter"
        )
    return device
