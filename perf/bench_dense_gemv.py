"""Decode-sized fp32 products on CPU: kernels.dense_linear's row kernel vs torch's F.linear.

For each weight shape N x K and row count M, both multiply x [M, K] by W [N, K]^T, cycling
through --cold copies of the weight (each its own memory, so it comes from L3 or memory as in a
decode step, which reads each weight once). Rounds interleave the two; medians of --repeats.
Prints µs per call, the weight bytes per second each reaches, and torch / ours (> 1: ours faster).

    python perf/bench_dense_gemv.py [--shapes 8192x256 2624x256 129280x4096] [--rows 1 2 4] [--cold 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from kernels import cpu_gemv  # noqa: E402
from perf.machine import header, set_cpu_threads  # noqa: E402


def _median_us(fn, weights, x, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            fn(x, w)
        times.append((time.perf_counter() - t) / len(weights))
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8192x256", "2624x256", "16384x4096"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cold", type=int, default=24, metavar="N", help="cycle through N copies of each weight")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(header("bench_dense_gemv"), flush=True)
    set_cpu_threads(args.threads)
    print(f"# {args.threads} thread(s); {args.cold} copies of each weight; medians of {args.repeats} interleaved "
          f"rounds; the row kernel takes M <= {cpu_gemv.DENSE_GEMV_MAX_ROWS}")
    print(f"{'N x K':>12s} {'M':>3s} {'torch us':>10s} {'ours us':>10s} {'torch GB/s':>11s} {'ours GB/s':>10s} "
          f"{'torch/ours':>11s}  max |diff| / bound")
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        weights = [torch.randn(n, k, generator=g) for _ in range(args.cold)]
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            for fn in (F.linear, kernels.dense_linear):          # warm-up (numba's cache, allocator)
                fn(x, weights[0])
            t_torch, t_ours = [], []
            for _ in range(3):
                t_torch.append(_median_us(F.linear, weights, x, args.repeats))
                t_ours.append(_median_us(kernels.dense_linear, weights, x, args.repeats))
            a, b = statistics.median(t_torch), statistics.median(t_ours)
            exact = x.double() @ weights[0].double().T
            bound = k * 2.0**-23 * (x.double().abs() @ weights[0].double().abs().T) + 1e-30
            err = ((kernels.dense_linear(x, weights[0]).double() - exact).abs() / bound).max().item()
            gbs = 4 * n * k / 1e3
            print(f"{shape:>12s} {m:3d} {a:10.1f} {b:10.1f} {gbs / a:11.1f} {gbs / b:10.1f} {a / b:10.2f}x  {err:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
