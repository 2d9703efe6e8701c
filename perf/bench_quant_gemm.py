"""Quantized-GEMM benchmark: the CPU paths (fused row kernels, tile decode + mm) vs dequantize-then-matmul.

One table per run, every ratio measured in that run. Columns, per op and activation rows M:
- ``cpu ms``: kernels.* on CPU tensors (weights stay FP8 / packed FP4; act_quant on), which takes
  the fused row kernels up to GEMV_MAX_ROWS rows (per expert) and the tiled path above;
- ``tiled ms``: the same call forced onto the tiled path (decode a weight tile, torch sgemm);
  ``fused/tiled`` is tiled / cpu where cpu took the fused kernels (the threshold's evidence);
- ``deq+mm ms``: engine/weights.py's dequantize_fp8 / dequantize_fp4 of the whole weight, then
  an fp32 matmul (F.grouped_mm for the grouped op) of the fake-quantized activation: the same
  math with the dequantized weight materialised per call;
- ``speedup``: deq+mm / cpu;
- ``bf16 mm ms``: a bf16 matmul on a weight dequantized once beforehand (what the engine pays per
  call today, holding the whole weight in bf16: 2 bytes per element instead of 1 or 0.5).
Times are medians of --repeats rounds after one warm-up (which also compiles or loads numba's
cache); each round calls every variant once, in turn, so a busy neighbour slows them alike.
torch's and numba's default thread counts unless --threads is given. On a shared
machine a 2-thread parallel region stalls whenever either core is taken, so run it twice or
with --threads 1.
``--gpu`` adds the Triton kernels vs a torch bf16 matmul on pre-dequantized weights (CUDA events).
Run from the repository root:
    python -m perf.bench_quant_gemm [--repeats R] [--rows 1,16,256] [--threads T] [--gpu]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numba
import torch
import torch.nn.functional as F

import kernels
from engine.weights import dequantize_fp4, dequantize_fp8
from kernels import cpu_quant_gemm, reference
from perf.machine import header, median_s, set_cpu_threads  # noqa: E402

# (name, kind, E, N, K, block or group): V4-Flash / V4.1-Flash-like projections, sized for a CPU.
CASES = [
    ("fp8 4096x1024 128x128", "fp8", 0, 4096, 1024, (128, 128)),
    ("fp8 2048x5120 32x32", "fp8", 0, 2048, 5120, (32, 32)),
    ("fp4 4096x4096 /32", "fp4", 0, 4096, 4096, 32),
    ("fp4 grouped 16x1024x2048", "fp4_grouped", 16, 1024, 2048, 32),
    # the tiny V4 of perf/compare_peer.py (hidden 256): wq_b and one layer's routed experts
    ("fp8 8192x256 128x128", "fp8", 0, 8192, 256, (128, 128)),
    ("fp4 grouped 64x256x256", "fp4_grouped", 64, 256, 256, 32),
]


def interleaved_medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds per call of each fn, the fns called in turn every round (after a warm-up)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def tiled(fn: Callable[[], object]) -> Callable[[], object]:
    """fn with the CPU kernels forced onto the tiled path."""
    def run() -> object:
        saved = cpu_quant_gemm.GEMV_MAX_ROWS, cpu_quant_gemm.FP4_GEMV_MAX_ROWS
        cpu_quant_gemm.GEMV_MAX_ROWS = cpu_quant_gemm.FP4_GEMV_MAX_ROWS = 0
        try:
            return fn()
        finally:
            cpu_quant_gemm.GEMV_MAX_ROWS, cpu_quant_gemm.FP4_GEMV_MAX_ROWS = saved
    return run


def make_weight(kind: str, e: int, n: int, k: int, q, g: torch.Generator):
    """Random stored weight and scales (ue8m0 bytes as float8_e8m0fnu) for a case."""
    lead = (e,) if kind == "fp4_grouped" else ()

    def s_bytes(*shape: int) -> torch.Tensor:
        return torch.randint(118, 128, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    if kind == "fp8":
        c = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
        w = torch.where((c & 0x7F) == 0x7F, 0, c).to(torch.uint8).view(torch.float8_e4m3fn)   # no NaN codes
        return w, s_bytes(-(-n // q[0]), -(-k // q[1])).view(torch.float8_e8m0fnu)
    w = torch.randint(-128, 128, (*lead, n, k // 2), generator=g, dtype=torch.int32).to(torch.int8)
    return w, s_bytes(*lead, n, -(-k // q)).view(torch.float8_e8m0fnu)


def offsets_for(rows: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """Cumulative ends of ``rows`` slots routed uniformly at random (some experts stay empty)."""
    counts = torch.bincount(torch.randint(0, experts, (rows,), generator=g), minlength=experts)
    return counts.cumsum(0).to(torch.int32)


def cpu_fns(kind: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, q, offs: torch.Tensor | None):
    """(cpu path, dequantize-then-matmul, bf16 matmul on a pre-dequantized weight)."""
    xq = lambda: reference.act_quant_fp8(x).float()         # noqa: E731 - same activation in the baseline
    if kind == "fp8":
        w16 = dequantize_fp8(w, s).bfloat16()
        return (lambda: kernels.fp8_linear(x, w, s, q, act_quant=True),
                lambda: (xq() @ dequantize_fp8(w, s).T).bfloat16(),
                lambda: x @ w16.T)
    if kind == "fp4":
        w16 = dequantize_fp4(w, s).bfloat16()
        return (lambda: kernels.fp4_linear(x, w, s, act_quant=True),
                lambda: (xq() @ dequantize_fp4(w, s).T).bfloat16(),
                lambda: x @ w16.T)
    w16 = dequantize_fp4(w, s).bfloat16().transpose(1, 2)
    return (lambda: kernels.fp4_grouped_mm(x, w, s, offs, act_quant=True),
            lambda: F.grouped_mm(xq(), dequantize_fp4(w, s).transpose(1, 2), offs=offs).bfloat16(),
            lambda: F.grouped_mm(x, w16, offs=offs))


def takes_fused(kind: str, m: int, offs: torch.Tensor | None) -> bool:
    limit = cpu_quant_gemm.GEMV_MAX_ROWS if kind == "fp8" else cpu_quant_gemm.FP4_GEMV_MAX_ROWS
    if offs is None:
        return 0 < m <= limit
    return m > 0 and int(torch.diff(offs, prepend=offs.new_zeros(1)).max()) <= limit


def run_cpu(rows: list[int], repeats: int) -> None:
    print(header("bench_quant_gemm"))
    print(f"torch threads {torch.get_num_threads()}, numba threads {numba.get_num_threads()}; "
          f"fused up to {cpu_quant_gemm.GEMV_MAX_ROWS} rows (FP8) / {cpu_quant_gemm.FP4_GEMV_MAX_ROWS} (FP4), per expert")
    print(f"{'case':26s} {'M':>5s} {'cpu ms':>9s} {'tiled ms':>9s} {'fused/tiled':>11s} {'deq+mm ms':>10s} "
          f"{'speedup':>8s} {'bf16 mm ms':>11s}")
    g = torch.Generator().manual_seed(0)
    for name, kind, e, n, k, q in CASES:
        w, s = make_weight(kind, e, n, k, q, g)
        for m in rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            offs = offsets_for(m, e, g) if e else None
            cpu, baseline, bf16 = cpu_fns(kind, x, w, s, q, offs)
            ours, tiles, base, b16 = interleaved_medians([cpu, tiled(cpu), baseline, bf16], repeats)
            gain = f"{tiles / ours:10.2f}x" if takes_fused(kind, m, offs) else f"{'-':>11s}"
            print(f"{name:26s} {m:5d} {ours * 1e3:9.3f} {tiles * 1e3:9.3f} {gain} {base * 1e3:10.2f} "
                  f"{base / ours:7.1f}x {b16 * 1e3:11.3f}")


def run_gpu(rows: list[int], repeats: int) -> None:
    dev = torch.device("cuda")
    print(f"\nGPU: {torch.cuda.get_device_name(dev)}")
    print(f"{'case':26s} {'M':>5s} {'triton ms':>10s} {'bf16 mm ms':>11s} {'ratio':>7s} {'weight GB/s':>12s}")
    g = torch.Generator().manual_seed(0)
    for name, kind, e, n, k, q in CASES:
        w, s = make_weight(kind, e, n, k, q, g)
        w16 = (dequantize_fp8(w, s) if kind == "fp8" else dequantize_fp4(w, s)).bfloat16().to(dev)
        w, s = w.to(dev), s.to(dev)
        for m in rows:
            x = torch.randn(m, k, generator=g).bfloat16().to(dev)
            if kind == "fp8":
                ours, theirs = lambda: kernels.fp8_linear(x, w, s, q, act_quant=True), lambda: x @ w16.T
            elif kind == "fp4":
                ours, theirs = lambda: kernels.fp4_linear(x, w, s, act_quant=True), lambda: x @ w16.T
            else:
                offs = offsets_for(m, e, g).to(dev)
                ours = lambda: kernels.fp4_grouped_mm(x, w, s, offs, act_quant=True)          # noqa: E731
                theirs = lambda: F.grouped_mm(x, w16.transpose(1, 2), offs=offs)              # noqa: E731
            t_ours, t_theirs = median_s(ours, repeats, cuda=True), median_s(theirs, repeats, cuda=True)
            gbps = (w.numel() * w.element_size() + s.numel()) / t_ours / 1e9
            print(f"{name:26s} {m:5d} {t_ours * 1e3:10.3f} {t_theirs * 1e3:11.3f} {t_theirs / t_ours:6.2f}x "
                  f"{gbps:12.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", default="1,4,8,16,32,256,768", help="comma-separated activation row counts M")
    parser.add_argument("--gpu", action="store_true", help="also time the Triton kernels (needs CUDA)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch and numba threads (default: theirs); 1 is steadier on a busy machine")
    args = parser.parse_args()
    if args.threads:
        set_cpu_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    run_cpu(rows, args.repeats)
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu: no CUDA device")
        run_gpu(rows, args.repeats)


if __name__ == "__main__":
    main()
