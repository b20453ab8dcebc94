"""Compile the Triton kernels for NVIDIA GPUs without a GPU: Triton lowers them
to PTX and its bundled ptxas assembles a cubin, the same steps a first launch
on an H100/H200 (sm_90) or A100 (sm_80) takes. Catches what the interpreter
cannot (lowering of tl.dot precisions, scalar atomics, bool stores, control
flow around them) and reports registers, spills and shared memory.

    .venv/bin/python tests/support/kernels/compile_check.py [KERNEL]   # one JSON line per variant

KERNEL (``five_head_vote`` or ``cosine_topk``) keeps that kernel's variants
only. The kernel tests run it in a subprocess (``fresh_process.py``: TRITON_INTERPRET
must be unset when the kernel modules are imported)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_pamer.kernels import _cosine_topk_triton as topk
from vllm_pamer.kernels import _five_head_vote_triton as vote

H200_SMS = 132
TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def vote_variant(B, d, x_dtype, w_dtype, arch=90):
    """What five_head_vote_triton would compile for these shapes on an H200."""
    p = vote.plan(B, d, 5, 256, x_dtype, w_dtype, interpreted=False, programs=3 * H200_SMS, precision="tf32x3")
    w = TY[w_dtype]
    ptrs = dict(
        x_ptr=f"*{TY[x_dtype]}",
        w1_ptr=f"*{w}",
        b1_ptr=f"*{w}",
        w2_ptr=f"*{w}",
        b2_ptr=f"*{w}",
        thr_ptr="*fp32",
        logits_ptr="*fp32",
        votes_ptr="*i32",
        decision_ptr="*i1",
        hpart_ptr="*fp32",
        lpart_ptr="*fp32",
        tile_count_ptr="*i32",
        block_count_ptr="*i32",
    )
    name = f"five_head_vote B={B} d={d} x={TY[x_dtype]} heads={w} grid={p['grid']}"
    return name, vote._five_head_vote_kernel, ptrs, p, arch


def topk_variant(B, N, e, k, dtype, arch=90):
    """What cosine_topk_triton would compile for these shapes on an H200."""
    p = topk.plan(B, N, e, k, dtype, dtype, interpreted=False, precision="tf32x3")
    ptrs = dict(
        q_ptr=f"*{TY[dtype]}",
        m_ptr=f"*{TY[dtype]}",
        qsess_ptr="*i64",
        rsess_ptr="*i64",
        key_ptr="*i64",
    )
    name = f"cosine_topk B={B} N={N} e={e} k={k} {TY[dtype]} grid={p['grid']}"
    return name, topk._tile_topk_kernel, ptrs, p, arch


VARIANTS = [
    vote_variant(1, 4096, torch.bfloat16, torch.float32),  # the worker's case: d split
    vote_variant(128, 4096, torch.bfloat16, torch.float32),
    vote_variant(64, 5120, torch.bfloat16, torch.bfloat16),  # tensor-core path
    vote_variant(16, 4096, torch.bfloat16, torch.bfloat16),  # the worker on CUDA: bf16 heads, d split
    topk_variant(1, 1_000_000, 1024, 8, torch.bfloat16),  # one query
    topk_variant(16, 1_000_000, 4096, 8, torch.float32),
    topk_variant(512, 100_000, 1024, 5, torch.bfloat16),  # BLOCK_B = 64
    topk_variant(64, 100_000, 4096, 8, torch.float32),
    topk_variant(16, 1_000_000, 1024, 8, torch.bfloat16, arch=80),
]


def ptxas_stats(ptx: str, arch: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas  # the ptxas Triton itself uses

    ptxas = get_ptxas(arch).path
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name={gpu}", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:] + proc.stdout[-2000:])
        log = proc.stderr + proc.stdout
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(
        registers=int(regs.group(1)) if regs else None,
        spill_stores=int(spill.group(1)) if spill else None,
        spill_loads=int(spill.group(2)) if spill else None,
    )


def main() -> int:
    wanted = sys.argv[1] if len(sys.argv) > 1 else ""
    for name, kernel, ptrs, p, arch in VARIANTS:
        if not name.startswith(wanted):
            continue
        constexprs = p["constexprs"]
        signature = {arg: ptrs.get(arg) or ("constexpr" if arg in constexprs else "i32") for arg in kernel.arg_names}
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
            target=GPUTarget("cuda", arch, 32),
            options=p["options"],
        )
        assert "cubin" in compiled.asm
        ptx = compiled.asm["ptx"]
        stats = dict(
            name=name,
            arch=f"sm_{arch}",
            **p["options"],
            shared_bytes=compiled.metadata.shared,
            atomics=ptx.count("atom.global"),
            **ptxas_stats(ptx, arch),
        )
        print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
