"""FP8 (e4m3) weight decode on CPU: integer arithmetic vs a 256-entry table, side by side.

kernels/cpu_quant_gemm.py decodes each e4m3 byte by integer arithmetic (`e4m3_value`): shifts,
masks and selects that LLVM vectorises. The decode it replaced looked each byte up in a
256-entry fp32 table, which vectorises as a gather. Both are run here in the fused GEMV's shape
(decode a weight row into an L1 buffer times its block scales, dot it with one activation row)
over a [N, K] weight, interleaved, medians of --repeats; cycles per weight element are at the
clock given by --ghz (the CPU model is printed: read them as ratios across machines).

    python perf/bench_fp8_decode.py [--shapes 4096x2048 8192x256] [--repeats 9] [--ghz 2.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu_quant_gemm import E4M3_TABLE, _decode_fp8_row, _dot_rows  # noqa: E402
from perf.machine import header, set_cpu_threads  # noqa: E402


@njit(cache=True, error_model="numpy")
def _gemv_arith(codes, sk, a, out):
    """The fused GEMV's row loop with its own decode (kernels/cpu_quant_gemm.py)."""
    w = np.empty(codes.shape[1], np.float32)
    for r in range(codes.shape[0]):
        _decode_fp8_row(codes[r], sk, w)
        _dot_rows(w, a, r, out)


@njit(cache=True, error_model="numpy")
def _gemv_table(codes, sk, table, a, out):
    """The same loop with the decode it replaced: a 256-entry table lookup per byte."""
    w = np.empty(codes.shape[1], np.float32)
    for r in range(codes.shape[0]):
        for j in range(w.shape[0]):
            w[j] = table[codes[r, j]] * sk[j]
        _dot_rows(w, a, r, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["4096x2048", "8192x256", "2048x5120"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--ghz", type=float, default=2.0)
    args = parser.parse_args()
    print(header("bench_fp8_decode"), flush=True)
    set_cpu_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"# one thread; medians of {args.repeats} interleaved rounds; cycles at {args.ghz} GHz")
    print(f"{'N x K':>11s} {'table ms':>9s} {'arith ms':>9s} {'table cyc/el':>13s} {'arith cyc/el':>13s} "
          f"{'speedup':>8s}  outputs")
    for shape in args.shapes:
        n, k = (int(x) for x in shape.split("x"))
        # weights like a trained checkpoint's: e4m3 codes of normal-ish values, per-block scales
        codes = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        codes = codes.view(torch.uint8).numpy()
        sk = (2.0 ** torch.randint(-12, -4, (k,), generator=g)).float().numpy()
        a = torch.randn(1, k, generator=g).numpy()
        out_t, out_a = np.empty((1, n), np.float32), np.empty((1, n), np.float32)
        _gemv_table(codes, sk, E4M3_TABLE, a, out_t)  # compile / load the cache
        _gemv_arith(codes, sk, a, out_a)
        same = np.array_equal(out_t, out_a)
        times = {"table": [], "arith": []}
        for _ in range(args.repeats):
            t = time.perf_counter()
            _gemv_table(codes, sk, E4M3_TABLE, a, out_t)
            times["table"].append(time.perf_counter() - t)
            t = time.perf_counter()
            _gemv_arith(codes, sk, a, out_a)
            times["arith"].append(time.perf_counter() - t)
        med = {v: statistics.median(ts) for v, ts in times.items()}
        cyc = {v: med[v] * args.ghz * 1e9 / (n * k) for v in med}
        print(f"{shape:>11s} {med['table'] * 1e3:9.2f} {med['arith'] * 1e3:9.2f} {cyc['table']:13.2f} "
              f"{cyc['arith']:13.2f} {med['table'] / med['arith']:7.2f}x  {'identical' if same else 'DIFFER'}",
              flush=True)


if __name__ == "__main__":
    main()
