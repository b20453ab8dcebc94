"""Kernel benchmarks: torch eager vs the fused Triton kernels, against the
bandwidth floor. Ratios to compare, not timed tests.

    .venv/bin/python -m benchmarks.kernels            # cuda if present, else cpu
    .venv/bin/python -m benchmarks.kernels --device cpu --reps 5

For each size it prints the median time of torch eager and of the fused
kernel, their ratio, and the time of a device-to-device copy measured in the
same run, as the floor: the kernel must read its weights (vote) or M and the
row sessions (Top-K) once, and a copy of the same bytes (read once, written
once) runs at the device's copy bandwidth; floor = bytes read / copy bandwidth
(read + written bytes per second). "x floor" is time / floor: 1.0 is
bandwidth-bound at copy speed. Progress and rows go to stderr as they come,
the tables to stdout at the end.

* five_head_vote: B in 1, 16, 128, 512 at d = 4096; rows bf16, heads fp32;
  torch eager = ``five_head_vote_reference`` (two einsums, GELU, compare,
  sum); "held" = ``FiveHeadVote`` as the worker calls it (a copy of the rows
  and a CUDA graph replay per call), with fp32 and with bf16 W1 (the worker's
  choice on CUDA).
* cosine_topk: N in 1e3, 1e5, 1e6 at e = 1024 and 4096, B = 16 queries, k = 8,
  16 sessions interleaved so every tile of M holds rows of the queries'
  sessions (the kernel's tile skipping never helps: its worst case); torch
  eager = ``torch.mm`` + session mask + ``torch.topk``. On CUDA it also times
  the torch path ``cosine_topk`` runs otherwise (norms, tie order) and prints
  the size from which the Triton kernel beat it: ``TRITON_FROM_ROWS``.

On CUDA every rep starts with a 256 MiB write so L2 holds nothing of the
inputs, and times come from CUDA events. On CPU the fused kernels cannot run
(Triton needs a GPU; the interpreter is for tests, not timing): only the torch
paths are timed, the CPU path of ``cosine_topk`` (the chunked reference, which
also computes norms and orders ties) is shown beside torch eager, and matrices
are capped at --cpu-max-bytes (rows reduced, marked "capped").
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
from tqdm import tqdm

from vllm_pamer.kernels import cosine_topk_reference, five_head_vote_reference


class Timer:
    def __init__(self, device: torch.device, reps: int, warmup: int) -> None:
        self.device, self.reps, self.warmup = device, reps, warmup
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(64 * 2**20, dtype=torch.int32, device=device) if self.cuda else None

    def __call__(self, fn) -> float:
        """Median seconds of ``fn()``."""
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def graph(self, fn) -> float | None:
        """Median seconds of one ``fn()`` replayed from a CUDA graph: the GPU's
        time without the Python launch cost (the events above include it when
        it outlasts the queued L2 flush). None where capture fails or on CPU."""
        if not self.cuda:
            return None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile and allocate outside capture
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):  # the stream fn's scratch was made on
                fn()
        except Exception as exc:
            tqdm.write(f"graph capture failed: {exc!r}", file=sys.stderr)
            return None
        return self(graph.replay)

    def copy_bandwidth(self, nbytes: int) -> float:
        """Bytes moved (read + written) per second by a device-to-device copy
        of ``nbytes`` (at most 256 MiB on CPU, where memory is short and the
        bandwidth no longer depends on the size there)."""
        if not self.cuda:
            nbytes = min(nbytes, 2**28)
        n = max(1, nbytes // 4)
        src = torch.empty(n, dtype=torch.float32, device=self.device).normal_()
        dst = torch.empty_like(src)
        seconds = self(lambda: dst.copy_(src))
        del src, dst
        return 2 * 4 * n / seconds


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None else f"{a / b:.2f}x"


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_vote(timer: Timer, device: torch.device, fused: bool, batches, d: int) -> tuple[list[str], list[str]]:
    rows, graph_rows = [], []
    g = torch.Generator(device="cpu").manual_seed(0)
    w1 = (torch.randn(5, d, 256, generator=g) / math.sqrt(d)).to(device)
    b1, w2 = (0.1 * torch.randn(5, 256, generator=g)).to(device), (torch.randn(5, 256, generator=g) / 16).to(device)
    b2, thr = (0.1 * torch.randn(5, generator=g)).to(device), torch.zeros(5, device=device)
    if fused:
        from vllm_pamer.kernels import FiveHeadVote, five_head_vote_triton

        # as the worker holds them: one graph per batch bucket, fp32 or bf16 W1
        held = FiveHeadVote(w1, b1, w2, b2, thr, 3, device)
        held16 = FiveHeadVote(w1, b1, w2, b2, thr, 3, device, bf16_heads=True)
    for B in tqdm(batches, desc="five_head_vote", leave=False):
        x = torch.randn(B, d, generator=g).to(device=device, dtype=torch.bfloat16)
        args = (x, w1, b1, w2, b2, thr, 3)
        read = nbytes(x, w1, b1, w2, b2, thr)
        floor = read / timer.copy_bandwidth(read)
        eager = timer(lambda: five_head_vote_reference(*args))
        fused_t = held_t = held16_t = None
        if fused:
            want, got = five_head_vote_reference(*args), five_head_vote_triton(*args)
            torch.testing.assert_close(got[0], want[0], atol=1e-3, rtol=1e-3)  # a sanity check, not the test
            fused_t = timer(lambda: five_head_vote_triton(*args))
            torch.testing.assert_close(held(x)[0], want[0], atol=1e-3, rtol=1e-3)
            held_t, held16_t = timer(lambda: held(x)), timer(lambda: held16(x))
            e_g, f_g = (
                timer.graph(lambda: five_head_vote_reference(*args)),
                timer.graph(lambda: five_head_vote_triton(*args)),
            )
            graph_rows.append(
                f"| {B} | {d} | {fmt_time(e_g)} | {fmt_time(f_g)} | {ratio(e_g, f_g)} | {ratio(f_g, floor)} |"
            )
        rows.append(
            f"| {B} | {d} | bf16 / fp32 | {fmt_time(eager)} | {fmt_time(fused_t)} | {ratio(eager, fused_t)} "
            f"| {fmt_time(held_t)} | {ratio(eager, held_t)} | {fmt_time(held16_t)} | {ratio(eager, held16_t)} "
            f"| {read / 2**20:.1f} MiB | {fmt_time(floor)} | {ratio(eager, floor)} | {ratio(fused_t, floor)} |"
        )
        tqdm.write(rows[-1], file=sys.stderr)
    return rows, graph_rows


def topk_torch_eager(q, qs, m, rs, k):
    """What one writes without the kernel: all scores, mask, topk."""
    s = torch.mm(q, m.T).float()
    s.masked_fill_(rs[None, :] != qs[:, None], float("-inf"))
    return s.topk(k, dim=1)


def bench_topk(
    timer, device, fused, sizes, dims, batch, k, dtype, cpu_max_bytes
) -> tuple[list[str], list[str], list[tuple[int, int, float, float]]]:
    """Table rows, GPU-time rows, and (N, e, torch path s, Triton s) for the dispatch."""
    rows, graph_rows, dispatch = [], [], []
    g = torch.Generator(device="cpu").manual_seed(1)
    if fused:
        from vllm_pamer.kernels import cosine_topk_triton
    for e in dims:
        for n_wanted in tqdm(sizes, desc=f"cosine_topk e={e}", leave=False):
            n, note = n_wanted, ""
            elem = torch.finfo(dtype).bits // 8
            if device.type == "cpu" and n * e * elem > cpu_max_bytes:
                n, note = cpu_max_bytes // (e * elem), f" (capped from {n_wanted:.0e})"
            m = torch.empty(n, e, dtype=dtype, device=device)
            for lo in range(0, n, 65536):  # fill in pieces: no fp32 copy of a large matrix
                hi = min(n, lo + 65536)
                m[lo:hi] = torch.nn.functional.normalize(torch.randn(hi - lo, e, generator=g), dim=1).to(device, dtype)
            rs = torch.randint(0, 16, (n,), generator=g).to(device)
            # unit queries too, so torch eager's dot products are the cosines
            q = torch.nn.functional.normalize(torch.randn(batch, e, generator=g), dim=1).to(device, dtype)
            qs = torch.arange(batch, device=device) % 16
            read = nbytes(m, rs, q)
            floor = read / timer.copy_bandwidth(read)
            eager = timer(lambda: topk_torch_eager(q, qs, m, rs, k))
            path = fused_t = None
            if fused:
                got = cosine_topk_triton(q, qs, m, rs, k)
                want = topk_torch_eager(q.float(), qs, m.float(), rs, k) if n * e <= 2**28 else None
                if want is not None:  # a sanity check, not the test
                    torch.testing.assert_close(got[1], want.values, atol=1e-3, rtol=1e-3)
                fused_t = timer(lambda: cosine_topk_triton(q, qs, m, rs, k))
                e_g, f_g = (
                    timer.graph(lambda: topk_torch_eager(q, qs, m, rs, k)),
                    timer.graph(lambda: cosine_topk_triton(q, qs, m, rs, k)),
                )
                graph_rows.append(
                    f"| {n:,} | {e} | {fmt_time(e_g)} | {fmt_time(f_g)} | {ratio(e_g, f_g)} | {ratio(f_g, floor)} |"
                )
                # what cosine_topk runs when it does not run the kernel
                dispatch.append((n, e, timer(lambda: cosine_topk_reference(q, qs, m, rs, k)), fused_t))
            else:
                path = timer(lambda: cosine_topk_reference(q, qs, m, rs, k))
            rows.append(
                f"| {n:,}{note} | {e} | {batch} | {str(dtype).split('.')[-1]} | {fmt_time(eager)} "
                f"| {fmt_time(fused_t if fused else path)} | {ratio(eager, fused_t if fused else path)} "
                f"| {read / 2**20:.1f} MiB | {fmt_time(floor)} | {ratio(eager, floor)} "
                f"| {ratio(fused_t if fused else path, floor)} |"
            )
            tqdm.write(rows[-1], file=sys.stderr)
            del m
    return rows, graph_rows, dispatch


def triton_from_rows(dispatch: list[tuple[int, int, float, float]]) -> int | None:
    """The smallest measured N from which the Triton kernel beat the torch path
    at every e and every larger N (``kernels.cosine_topk.TRITON_FROM_ROWS``);
    None when it never did."""
    sizes = sorted({n for n, *_ in dispatch})
    wins = {n: all(t < path for m, _, path, t in dispatch if m == n) for n in sizes}
    start = None
    for n in reversed(sizes):
        if not wins[n]:
            break
        start = n
    return start


def sweep(timer: Timer, device: torch.device) -> list[str]:
    """GPU time (graph replay) of each tile configuration the launchers accept,
    against their default plan, to choose the defaults from measurements.
    Every configuration's output is checked against torch first."""
    from vllm_pamer.kernels import cosine_topk_triton, five_head_vote_triton

    rows = []
    g = torch.Generator(device="cpu").manual_seed(2)

    def best_of(name, size, call, want, configs):
        results = []
        for cfg in tqdm(configs, desc=f"sweep {name} {size}", leave=False):
            try:
                got = call(**cfg)
                torch.testing.assert_close(got[1 if name == "topk" else 0].float(), want, atol=2e-3, rtol=2e-3)
                results.append((timer.graph(lambda: call(**cfg)), cfg))
            except Exception as exc:
                tqdm.write(f"{name} {size} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        default = next((t for t, c in results if not c), None)
        timed = [(t, c) for t, c in results if t is not None]
        t_best, c_best = min(timed, key=lambda r: r[0]) if timed else (None, None)
        rows.append(
            f"| {name} | {size} | {fmt_time(default)} | {fmt_time(t_best)} | {c_best} | {ratio(default, t_best)} |"
        )
        tqdm.write(rows[-1], file=sys.stderr)

    d = 4096
    w1 = (torch.randn(5, d, 256, generator=g) / math.sqrt(d)).to(device)
    b1, w2 = (0.1 * torch.randn(5, 256, generator=g)).to(device), (torch.randn(5, 256, generator=g) / 16).to(device)
    b2, thr = (0.1 * torch.randn(5, generator=g)).to(device), torch.zeros(5, device=device)
    vote_cfgs = [{}] + [
        dict(block_w=w, block_d=bd, num_splits=ns) for w in (32, 64) for bd in (32, 64, 128) for ns in (None, 1, 8)
    ]
    for B in (1, 16, 128):
        for w_dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(B, d, generator=g).to(device=device, dtype=torch.bfloat16)
            args = (x, w1.to(w_dtype), b1, w2, b2, thr, 3)
            want = five_head_vote_reference(*args)[0]
            best_of(
                "vote",
                f"B={B} heads {str(w_dtype).split('.')[-1]}",
                lambda **c: five_head_vote_triton(*args, **c),
                want,
                vote_cfgs,
            )
    topk_cfgs = [{}] + [dict(block_n=bn, block_e=be) for bn in (64, 128, 256) for be in (32, 64, 128)]
    for n, e in ((100_000, 1024), (1_000_000, 1024), (100_000, 4096), (1_000_000, 4096)):
        m = torch.empty(n, e, dtype=torch.bfloat16, device=device)
        for lo in range(0, n, 65536):
            hi = min(n, lo + 65536)
            m[lo:hi] = torch.nn.functional.normalize(torch.randn(hi - lo, e, generator=g), dim=1).to(device, m.dtype)
        rs = torch.randint(0, 16, (n,), generator=g).to(device)
        q = torch.nn.functional.normalize(torch.randn(16, e, generator=g), dim=1).to(device, m.dtype)
        qs = torch.arange(16, device=device) % 16
        want = cosine_topk_triton(q, qs, m, rs, 8)[1]
        best_of("topk", f"N={n:,} e={e}", lambda **c: cosine_topk_triton(q, qs, m, rs, 8, **c), want, topk_cfgs)
        del m
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=None, help="timed reps per case (default 50 cuda, 5 cpu)")
    parser.add_argument("--cpu-max-bytes", type=int, default=2**31, help="cap on M's bytes on CPU")
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--sweep", action="store_true", help="CUDA: also time every tile configuration")
    args = parser.parse_args()
    device = torch.device(args.device)
    fused = device.type == "cuda"
    reps = args.reps or (50 if fused else 5)
    timer = Timer(device, reps=reps, warmup=3 if fused else 1)

    if fused:
        from vllm_pamer.kernels import triton_available

        assert triton_available(), "CUDA without triton: nothing fused to measure"
        where = f"{torch.cuda.get_device_name(device)}"
    else:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        where = f"CPU, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores, load average {load}"
    print(f"# kernels benchmark on {where}; torch {torch.__version__}; median of {reps} reps")
    if not fused:
        print("# CPU: torch paths only; the fused Triton kernels need a CUDA GPU (not measured here)")

    batches = [1, 16, 128] if args.quick else [1, 16, 128, 512]
    sizes = [1000, 100_000] if args.quick else [1000, 100_000, 1_000_000]
    dims = [1024] if args.quick else [1024, 4096]
    vote_rows, vote_graph = bench_vote(timer, device, fused, batches, d=4096)
    topk_dtype = torch.bfloat16 if fused else torch.float32
    topk_rows, topk_graph, dispatch = bench_topk(
        timer, device, fused, sizes, dims, 16, 8, topk_dtype, args.cpu_max_bytes
    )

    print("\n## five_head_vote (d = 4096, 5 heads x 256, min_votes = 3)\n")
    print(
        "| B | d | x / heads | torch eager | fused Triton | speed-up | held, graph | speed-up "
        "| held, bf16 heads, graph | speed-up | bytes read | floor | eager x floor | fused x floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(vote_rows))
    second = "fused Triton" if fused else "torch path (cosine_topk on CPU)"
    print("\n## cosine_topk (B = 16 queries, k = 8, 16 interleaved sessions)\n")
    print(
        f"| N | e | B | M dtype | torch mm + topk | {second} | speed-up | bytes read | floor | eager x floor | "
        f"{'fused' if fused else 'path'} x floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(topk_rows))
    if fused:
        print("\n## GPU time alone (one call replayed from a CUDA graph, L2 flushed before each)\n")
        print("| B or N | d or e | torch eager | fused Triton | speed-up | fused x floor |")
        print("|---|---|---|---|---|---|")
        print("\n".join(vote_graph + topk_graph))
    if fused:
        print("\n## cosine_topk dispatch (caller-visible; both answer the contract: ties by lower row)\n")
        print("| N | e | torch path (cosine_topk_reference) | Triton tile pass + merge | Triton speed-up |")
        print("|---|---|---|---|---|")
        for n, e, path, t in dispatch:
            print(f"| {n:,} | {e} | {fmt_time(path)} | {fmt_time(t)} | {ratio(path, t)} |")
        print(f"\nTRITON_FROM_ROWS measured: {triton_from_rows(dispatch)} (kernels/cosine_topk.py)")
    if fused and args.sweep:
        print("\n## Tile sweep (GPU time, graph replay; config {} = the launcher's default plan)\n")
        print("| kernel | case | default plan | best | best config | default / best |")
        print("|---|---|---|---|---|---|")
        print("\n".join(sweep(timer, device)))


if __name__ == "__main__":
    main()
