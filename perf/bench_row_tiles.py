"""Multi-row decode products on CPU: the row kernels' weight tiles against the previous loop order.

A decode step of B sequences multiplies B activation rows by each weight. The FP8 and dense
products now share one row kernel (kernels/cpu_gemv.py `_dot_rows`, which kernels/cpu_quant_gemm.py
`_fp8_dot_rows` calls for more than one row): it walks the weight rows in tiles of about 16 KiB,
a pass of four activation rows over a whole tile, so the pass's activation rows stay in L1 while
the tile's rows go by. The previous kernels, kept here as
baselines, finished one weight row against every activation row before the next, so from
K ~ 1024 the activation rows came from L2 again for every weight row; the previous dense kernel
also dotted one activation row at a time, and the previous activation scaling of the FP8 kernel
(`_scale_activations`) ran scalar (a signed index from a computed start).

  fp8    e4m3 codes with 64 x 64 block scales (the tiny V4s' attention projections): previous =
         untiled passes + scalar scaling, current = `q._fp8_gemv`
  bf16   bf16 bits of a dense weight (the LM head, the compressors' projections)
  fp32   a dense fp32 weight

Both sides run the same parallel split (weight rows in tasks of `_rows_per_task`); weights cycle
through --cold copies so they come from L3 or memory as in a decode step. Prints ms per call,
previous / current (> 1: current faster) and whether the outputs are identical bit for bit.

    python perf/bench_row_tiles.py [--threads 2] [--rows 1 4 16] [--cold 3]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cpu_gemv  # noqa: E402
from kernels import cpu_quant_gemm as q  # noqa: E402
from kernels.cpu_gemv import weight_value  # noqa: E402
from kernels.cpu_numerics import F32, borrow, half_value  # noqa: E402
from perf.machine import header, set_cpu_threads  # noqa: E402

# (format, N, K): the wide-fp8 / deep-fp8 projections and LM heads of perf/peer_llamacpp.py
SHAPES = [("fp8", 1024, 2048), ("fp8", 2048, 512), ("fp8", 576, 1024), ("fp8", 256, 1024),
          ("bf16", 16384, 1024), ("bf16", 520, 1024), ("bf16", 32000, 128), ("fp32", 4096, 512)]
BLOCK = 64


# ---- the previous kernels (baselines) ----------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _scale_signed(a, srow, block_k, dst):
    """The previous `_scale_activations`: the same values, a signed index from kb · block_k."""
    for i in range(a.shape[0]):
        ai, di = a[i], dst[i]
        for kb in range(srow.shape[0]):
            v = q.scale_value(srow[kb])
            for j in range(kb * block_k, min(ai.shape[0], (kb + 1) * block_k)):
                di[j] = ai[j] * v * F32(256.0)


@njit(cache=True, error_model="numpy", fastmath=q._DOT_MATH)
def _fp8_untiled(codes, r0, r1, scaled, out):
    """The previous multi-row `_fp8_dot_rows`: each weight row against every pass of activation rows."""
    m, k = scaled.shape
    if m == 1:
        q._fp8_dot_one_row(codes, r0, r1, scaled, out)
        return
    for r in range(r0, r1):
        for i in range(0, m - 3, 4):
            acc0, acc1, acc2, acc3 = F32(0), F32(0), F32(0), F32(0)
            for j in range(k):
                w = half_value(q.e4m3_half_bits(codes[r, j]))
                acc0 += w * scaled[i, j]
                acc1 += w * scaled[i + 1, j]
                acc2 += w * scaled[i + 2, j]
                acc3 += w * scaled[i + 3, j]
            out[i, r], out[i + 1, r], out[i + 2, r], out[i + 3, r] = acc0, acc1, acc2, acc3
        for i in range(m - m % 4, m - 1, 2):
            acc0, acc1 = F32(0), F32(0)
            for j in range(k):
                w = half_value(q.e4m3_half_bits(codes[r, j]))
                acc0 += w * scaled[i, j]
                acc1 += w * scaled[i + 1, j]
            out[i, r], out[i + 1, r] = acc0, acc1
        if m % 2:
            acc = F32(0)
            for j in range(k):
                acc += half_value(q.e4m3_half_bits(codes[r, j])) * scaled[m - 1, j]
            out[m - 1, r] = acc


@njit(parallel=True, cache=True, error_model="numpy")
def _fp8_gemv_previous(codes_arg, scale_arg, block_n, block_k, a_arg, out_arg, per):
    codes, scale, a, out = borrow(codes_arg), borrow(scale_arg), borrow(a_arg), borrow(out_arg)
    n = codes.shape[0]
    for task in prange((n + per - 1) // per):
        r, r1 = task * per, min(n, (task + 1) * per)
        scaled = np.empty(a.shape, np.float32)
        while r < r1:
            end = min(r1, (r // block_n + 1) * block_n)
            _scale_signed(a, scale[r // block_n], block_k, scaled)
            _fp8_untiled(codes, r, end, scaled, out)
            r = end


@njit(cache=True, error_model="numpy", fastmath=cpu_gemv._DOT_MATH)
def _dense_one_at_a_time(w, a, r0, r1, out):
    """The previous `_dot_rows` / `_dot_rows_bf16`: each weight row against one activation row at a time."""
    k = w.shape[1]
    for r in range(r0, r1):
        for i in range(a.shape[0]):
            acc = F32(0)
            for j in range(k):
                acc += weight_value(w[r, j]) * a[i, j]
            out[i, r] = acc


@njit(parallel=True, cache=True, error_model="numpy")
def _dense_gemv_previous(w_arg, a_arg, out_arg, per):
    w, a, out = borrow(w_arg), borrow(a_arg), borrow(out_arg)
    n = w.shape[0]
    for task in prange((n + per - 1) // per):
        _dense_one_at_a_time(w, a, task * per, min(n, (task + 1) * per), out)


# ---- the bench ---------------------------------------------------------------------------------

def _weights(fmt: str, n: int, k: int, g: torch.Generator) -> tuple:
    """One weight as the kernels take it: (codes, scales) for FP8, (weight,) for the dense ones."""
    if fmt == "fp8":
        codes = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        exps = torch.randint(-12, -4, (-(-n // BLOCK), -(-k // BLOCK)), generator=g)
        return codes.view(torch.uint8).numpy(), (exps + 127).to(torch.uint8).numpy()
    w = torch.randn(n, k, generator=g)
    return (w.bfloat16().view(torch.uint16).numpy(),) if fmt == "bf16" else (w.numpy(),)


def _pair(fmt: str, per: int):
    """(previous, current) as f(weight tuple, a, out)."""
    if fmt == "fp8":
        return (lambda w, a, o: _fp8_gemv_previous(*w, BLOCK, BLOCK, a, o, per),
                lambda w, a, o: q._fp8_gemv(*w, BLOCK, BLOCK, a, o, per))
    return (lambda w, a, o: _dense_gemv_previous(*w, a, o, per),
            lambda w, a, o: cpu_gemv._gemv(*w, a, o, per))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--cold", type=int, default=3, metavar="N", help="cycle through N copies of each weight")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(header("bench_row_tiles"), flush=True)
    set_cpu_threads(args.threads)
    print(f"# {args.threads} thread(s); {args.cold} copies of each weight; medians of {args.repeats} calls, "
          f"3 interleaved rounds; FP8 blocks {BLOCK} x {BLOCK}")
    print(f"{'format':>6s} {'N x K':>11s} {'M':>3s} {'previous ms':>12s} {'current ms':>11s} {'prev/cur':>9s}  outputs")
    g = torch.Generator().manual_seed(0)
    for fmt, n, k in SHAPES:
        copies = [_weights(fmt, n, k, g) for _ in range(args.cold)]
        calls = itertools.count()
        for m in args.rows:
            a = torch.randn(m, k, generator=g).numpy()
            previous, current = _pair(fmt, q._rows_per_task(n))
            outs = [np.full((m, n), np.nan, np.float32) for _ in range(2)]
            times: list[list[float]] = [[], []]
            for _ in range(3):
                for side, fn in enumerate((previous, current)):
                    fn(copies[0], a, outs[side])                      # warm-up: numba's cache
                    ts = []
                    for _ in range(args.repeats):
                        w = copies[next(calls) % len(copies)]
                        t = time.perf_counter()
                        fn(w, a, outs[side])
                        ts.append(time.perf_counter() - t)
                    times[side].append(statistics.median(ts))
            previous(copies[0], a, outs[0])
            current(copies[0], a, outs[1])
            same = np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
            p, c = (1e3 * statistics.median(t) for t in times)
            print(f"{fmt:>6s} {f'{n}x{k}':>11s} {m:3d} {p:12.3f} {c:11.3f} {p / c:8.2f}x  "
                  f"{'identical' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
