"""FP8 (e4m3) weight decode on CPU: three decodes of the fused GEMV, side by side.

kernels/cpu_quant_gemm.py's fused GEMV decodes each weight row into an L1 buffer and dots it with
the activation rows. How it turns e4m3 bytes into fp32 decides its speed:
  table  a 256-entry fp32 table lookup per byte (a gather), times the row's expanded block scales
  arith  integer arithmetic (`e4m3_value`: shifts, masks, selects), times the expanded scales
  half   the current kernel: the byte's fields shifted into IEEE half bits (`e4m3_half_bits`),
         converted by vcvtph2ps (`half_value`), no scale; the activations carry the block scales
         instead (`_scale_activations`, once per block row of 128 weight rows)
All three run the same row loop over one [N, K] weight with [N/128, K/128] power-of-two block
scales and one activation row, interleaved, medians of --repeats; their outputs are compared
bit for bit. Cycles per weight element are at the clock given by --ghz (the CPU model is
printed: read them as ratios across machines).

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

from kernels.cpu_quant_gemm import (E4M3_TABLE, _decode_fp8_row, _dot_rows, _expand_scales,  # noqa: E402
                                    _scale_activations, e4m3_value)
from perf.machine import header, set_cpu_threads  # noqa: E402

BLOCK = 128


@njit(cache=True, error_model="numpy")
def _gemv_table(codes, scale, table, a, out):
    w, sk = np.empty(codes.shape[1], np.float32), np.empty(codes.shape[1], np.float32)
    for r in range(codes.shape[0]):
        if r % BLOCK == 0:
            _expand_scales(scale[r // BLOCK], BLOCK, sk)
        for j in range(w.shape[0]):
            w[j] = table[codes[r, j]] * sk[j]
        _dot_rows(w, a, r, out)


@njit(cache=True, error_model="numpy")
def _gemv_arith(codes, scale, a, out):
    w, sk = np.empty(codes.shape[1], np.float32), np.empty(codes.shape[1], np.float32)
    for r in range(codes.shape[0]):
        if r % BLOCK == 0:
            _expand_scales(scale[r // BLOCK], BLOCK, sk)
        for j in range(w.shape[0]):
            w[j] = e4m3_value(codes[r, j]) * sk[j]
        _dot_rows(w, a, r, out)


@njit(cache=True, error_model="numpy")
def _gemv_half(codes, scale, a, out):
    w, scaled = np.empty(codes.shape[1], np.float32), np.empty(a.shape, np.float32)
    for r in range(codes.shape[0]):
        if r % BLOCK == 0:
            _scale_activations(a, scale[r // BLOCK], BLOCK, scaled)
        _decode_fp8_row(codes[r], w)
        _dot_rows(w, scaled, r, out)


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
    print(f"{'N x K':>11s} {'table cyc/el':>13s} {'arith cyc/el':>13s} {'half cyc/el':>12s} "
          f"{'table/half':>11s} {'arith/half':>11s}  outputs")
    for shape in args.shapes:
        n, k = (int(x) for x in shape.split("x"))
        # weights like a trained checkpoint's: e4m3 codes of normal-ish values, per-block scales
        codes = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        codes = codes.view(torch.uint8).numpy()
        exps = torch.randint(-12, -4, (-(-n // BLOCK), -(-k // BLOCK)), generator=g)
        scale = (exps + 127).to(torch.uint8).numpy()           # ue8m0 bytes: 2^-12 .. 2^-5
        a = torch.randn(1, k, generator=g).numpy()
        outs = {v: np.empty((1, n), np.float32) for v in ("table", "arith", "half")}
        runs = {"table": lambda o: _gemv_table(codes, scale, E4M3_TABLE, a, o),
                "arith": lambda o: _gemv_arith(codes, scale, a, o),
                "half": lambda o: _gemv_half(codes, scale, a, o)}
        for v, run in runs.items():
            run(outs[v])  # compile / load the cache
        same = np.array_equal(outs["table"], outs["arith"]) and np.array_equal(outs["table"], outs["half"])
        times = {v: [] for v in runs}
        for _ in range(args.repeats):
            for v, run in runs.items():
                t = time.perf_counter()
                run(outs[v])
                times[v].append(time.perf_counter() - t)
        med = {v: statistics.median(ts) for v, ts in times.items()}
        cyc = {v: med[v] * args.ghz * 1e9 / (n * k) for v in med}
        print(f"{shape:>11s} {cyc['table']:13.2f} {cyc['arith']:13.2f} {cyc['half']:12.2f} "
              f"{med['table'] / med['half']:10.2f}x {med['arith'] / med['half']:10.2f}x  "
              f"{'identical' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
