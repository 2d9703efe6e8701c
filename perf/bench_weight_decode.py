"""FP8 / FP4 weight decode on CPU: the fused GEMV's decodes, side by side.

kernels/cpu_quant_gemm.py's fused GEMV reads each weight byte once. How it turns e4m3 bytes into
fp32 decides its speed:
  table  a 256-entry fp32 table lookup per byte (a gather) into an L1 row buffer, times the
         row's expanded block scales, then the dot product
  arith  integer arithmetic (`e4m3_value`: shifts, masks, selects) into the row buffer, times
         the expanded scales, then the dot product
  half   the byte's fields shifted into IEEE half bits (`e4m3_half_bits`), converted by
         vcvtph2ps (`half_value`) into the row buffer, no scale: the activations carry the block
         scales instead (`_scale_activations`, once per block row of 128 weight rows); then the dot
  select as fused, with the previous half-bits decode (the fields masked and shifted apart, the
         NaN codes picked by a compare and select): eight vector ops per 8 codes instead of five
  row1   the half decode inside the dot product, no row buffer (the decoded weights never
         leave registers), one weight row per pass: the previous fused kernel
  adj4   as row1, with four adjacent weight rows per pass sharing each activation load: the
         previous batch-1 kernel
  fused  the current kernel (`_fp8_dot_rows`): as adj4, with the four rows a quarter of each
         128-row block apart (`_fp8_dot_one_row`, the batch-1 path)
For packed MXFP4 (e2m1 pairs, a ue8m0 scale per row and 32 elements):
  expand  a 256-entry pair table lookup per byte (both values as one uint64), the row's scales
          expanded into a [K] buffer and multiplied, calls per row (an older kernel)
  groups  the pair-table lookup, then the scales group by group (a loop of literal length 32),
          every row's loops inside one call (the previous kernel)
  split   the current kernel (kernels/cpu_quant_gemm.py `_fp4_dot_rows`): each nibble through
          half bits into an even and an odd buffer (no table, straight vector loops), the
          activations' even and odd columns apart
Interleaved, medians of --repeats; outputs compared bit for bit. Cycles per weight element
are at the clock given by --ghz (the CPU model is printed: read them as ratios across machines).
--cold N gives every call the next of N copies of the weight (same values, own memory), so it
comes from L3 or memory as in a decode step, which reads each weight once (the default: the
same weight every call, warm in L2 when it fits).

    python perf/bench_weight_decode.py [--shapes 4096x2048 8192x256] [--repeats 9] [--ghz 2.0] [--cold 24]
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
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu_numerics import F32, U16, half_value  # noqa: E402
from kernels.cpu_quant_gemm import (E2M1_TABLE, E4M3_TABLE, _DOT_MATH, _fp4_dot_rows,  # noqa: E402
                                    _fp8_dot_rows, scale_value, _scale_activations, e4m3_half_bits,
                                    e4m3_value)
from perf.machine import header, set_cpu_threads  # noqa: E402

BLOCK = 128
# Both values of a packed byte b as one uint64: e2m1(b & 15) in the low 4 bytes (the first
# element), e2m1(b >> 4) in the high ones; little-endian, as every CPU torch runs on.
_BYTES = np.arange(256)
E2M1_PAIR_TABLE = np.ascontiguousarray(
    np.stack([E2M1_TABLE[_BYTES & 15], E2M1_TABLE[_BYTES >> 4]], axis=1).astype(np.float32).view(np.uint64)[:, 0])


# ---- the previous kernels' pieces (baselines) --------------------------------------------------

@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH)
def _dot_rows(w, a, r, out):
    """out[i, r] = w . a[i] for every activation row i; w [K] fp32 (a decoded row buffer)."""
    for i in range(a.shape[0]):
        acc = F32(0)
        for j in range(w.shape[0]):
            acc += w[j] * a[i, j]
        out[i, r] = acc


@njit(cache=True, error_model="numpy")
def _expand_scales(srow, block, dst):
    """dst[k] = value of srow[k // block]: one scale per weight element of a row."""
    for kb in range(srow.shape[0]):
        v = scale_value(srow[kb])
        for j in range(kb * block, min(dst.shape[0], (kb + 1) * block)):
            dst[j] = v


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
            _scale_activations(a, scale[r // BLOCK], BLOCK, scaled)     # a · s · 256
        for j in range(w.shape[0]):
            w[j] = half_value(e4m3_half_bits(codes[r, j]))              # e4m3 / 256
        _dot_rows(w, scaled, r, out)


@njit(cache=True, error_model="numpy")
def _half_bits_select(code):
    """The previous `e4m3_half_bits`: magnitude and sign moved separately, NaN codes selected."""
    b = U16(code)
    mag = U16(b & U16(127))
    h = U16(U16(mag << U16(7)) | U16(U16(b & U16(128)) << U16(8)))
    return U16(h | (U16(0x7E00) if mag == U16(127) else U16(0)))


@njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _gemv_row_by_row(half_bits, codes, scale, a, out):
    """The half decode inside the dot product, one weight row per pass; half_bits: the jitted
    e4m3 -> half-bits decode (select: the previous one, row1: the current one)."""
    scaled = np.empty(a.shape, np.float32)
    for r in range(codes.shape[0]):
        if r % BLOCK == 0:
            _scale_activations(a, scale[r // BLOCK], BLOCK, scaled)
        acc = F32(0)
        for j in range(codes.shape[1]):
            acc += half_value(half_bits(codes[r, j])) * scaled[0, j]
        out[0, r] = acc


@njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _gemv_adjacent4(codes, scale, a, out):
    """The half decode inside the dot product, four adjacent weight rows per pass."""
    scaled = np.empty(a.shape, np.float32)
    for r0 in range(0, codes.shape[0], BLOCK):
        _scale_activations(a, scale[r0 // BLOCK], BLOCK, scaled)
        r1 = min(r0 + BLOCK, codes.shape[0])
        r = r0
        while r + 3 < r1:
            acc0, acc1, acc2, acc3 = F32(0), F32(0), F32(0), F32(0)
            for j in range(codes.shape[1]):
                x = scaled[0, j]
                acc0 += half_value(e4m3_half_bits(codes[r, j])) * x
                acc1 += half_value(e4m3_half_bits(codes[r + 1, j])) * x
                acc2 += half_value(e4m3_half_bits(codes[r + 2, j])) * x
                acc3 += half_value(e4m3_half_bits(codes[r + 3, j])) * x
            out[0, r], out[0, r + 1], out[0, r + 2], out[0, r + 3] = acc0, acc1, acc2, acc3
            r += 4
        for rr in range(r, r1):
            acc = F32(0)
            for j in range(codes.shape[1]):
                acc += half_value(e4m3_half_bits(codes[rr, j])) * scaled[0, j]
            out[0, rr] = acc


@njit(cache=True, error_model="numpy")
def _gemv_fused(codes, scale, a, out):
    scaled = np.empty(a.shape, np.float32)
    for r in range(0, codes.shape[0], BLOCK):
        _scale_activations(a, scale[r // BLOCK], BLOCK, scaled)
        _fp8_dot_rows(codes, r, min(r + BLOCK, codes.shape[0]), scaled, out)


@njit(cache=True, error_model="numpy")
def _gemv_fp4_expand(packed, scale, pair_table, a, out):
    pairs, sk = np.empty(packed.shape[1], np.uint64), np.empty(2 * packed.shape[1], np.float32)
    w = pairs.view(np.float32)
    for r in range(packed.shape[0]):
        _expand_scales(scale[r], 32, sk)
        for j in range(packed.shape[1]):
            pairs[j] = pair_table[packed[r, j]]
        for j in range(w.shape[0]):
            w[j] *= sk[j]
        _dot_rows(w, a, r, out)


@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH)
def _gemv_fp4_groups(packed, scale, pair_table, a, out):
    pairs = np.empty(packed.shape[1], np.uint64)
    w = pairs.view(np.float32)                                      # [K]
    groups = scale.shape[1]
    for r in range(packed.shape[0]):
        for j in range(packed.shape[1]):
            pairs[j] = pair_table[packed[r, j]]
        for g in range(groups):
            v = scale_value(scale[r, g])
            for j in range(32):
                w[32 * g + j] *= v
        _dot_rows(w, a, r, out)


@njit(cache=True, error_model="numpy")
def _gemv_fp4_split(packed, scale, a_even, a_odd, out):
    half = packed.shape[1]
    _fp4_dot_rows(packed, scale, 0, packed.shape[0], 32, a_even, a_odd, np.empty(half, np.float32),
                  np.empty(half, np.float32), out)


def _time(runs: dict, outs: dict, repeats: int) -> dict:
    """Median seconds per variant, rounds interleaved."""
    for v, run in runs.items():
        run(outs[v])  # compile / load the cache
    times = {v: [] for v in runs}
    for _ in range(repeats):
        for v, run in runs.items():
            t = time.perf_counter()
            run(outs[v])
            times[v].append(time.perf_counter() - t)
    return {v: statistics.median(ts) for v, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["4096x2048", "8192x256", "256x2048", "2048x5120"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--ghz", type=float, default=2.0)
    parser.add_argument("--cold", type=int, default=1, metavar="N", help="cycle through N copies of each weight")
    args = parser.parse_args()
    print(header("bench_weight_decode"), flush=True)
    set_cpu_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"# one thread; medians of {args.repeats} interleaved rounds; cycles at {args.ghz} GHz; "
          f"{args.cold} cop{'y' if args.cold == 1 else 'ies'} of each weight")
    names = ("table", "arith", "half", "select", "row1", "adj4", "fused")
    print(f"{'N x K':>11s} " + " ".join(f"{v + ' cyc/el':>13s}" for v in names) + " "
          + " ".join(f"{v + '/fused':>12s}" for v in names[:-1]) + "  outputs")
    for shape in args.shapes:
        n, k = (int(x) for x in shape.split("x"))
        # weights like a trained checkpoint's: e4m3 codes of normal-ish values, per-block scales
        codes = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        codes = codes.view(torch.uint8).numpy()
        exps = torch.randint(-12, -4, (-(-n // BLOCK), -(-k // BLOCK)), generator=g)
        scale = (exps + 127).to(torch.uint8).numpy()           # ue8m0 bytes: 2^-12 .. 2^-5
        a = torch.randn(1, k, generator=g).numpy()
        outs = {v: np.empty((1, n), np.float32) for v in names}
        copies = [(codes.copy(), scale.copy()) for _ in range(args.cold)]
        calls = itertools.count()

        def weight():
            return copies[next(calls) % len(copies)]
        runs = {"table": lambda o: _gemv_table(*weight(), E4M3_TABLE, a, o),
                "arith": lambda o: _gemv_arith(*weight(), a, o),
                "half": lambda o: _gemv_half(*weight(), a, o),
                "select": lambda o: _gemv_row_by_row(_half_bits_select, *weight(), a, o),
                "row1": lambda o: _gemv_row_by_row(e4m3_half_bits, *weight(), a, o),
                "adj4": lambda o: _gemv_adjacent4(*weight(), a, o),
                "fused": lambda o: _gemv_fused(*weight(), a, o)}
        med = _time(runs, outs, args.repeats)
        same = all(np.array_equal(outs["table"], outs[v]) for v in names)
        cyc = {v: med[v] * args.ghz * 1e9 / (n * k) for v in med}
        print(f"{shape:>11s} " + " ".join(f"{cyc[v]:13.2f}" for v in names) + " "
              + " ".join(f"{med[v] / med['fused']:11.2f}x" for v in names[:-1])
              + f"  {'identical' if same else 'DIFFER'}", flush=True)
    print("\n# MXFP4 (e2m1 pairs, a ue8m0 scale per row and 32 elements)")
    fp4_names = ("expand", "groups", "split")
    print(f"{'N x K':>11s} " + " ".join(f"{v + ' cyc/el':>13s}" for v in fp4_names) + " "
          + " ".join(f"{v + '/split':>13s}" for v in fp4_names[:-1]) + "  outputs")
    for shape in args.shapes:
        n, k = (int(x) for x in shape.split("x"))
        packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8).numpy()
        scale = torch.randint(120, 130, (n, -(-k // 32)), generator=g, dtype=torch.uint8).numpy()
        a = torch.randn(1, k, generator=g).numpy()
        a_even, a_odd = np.ascontiguousarray(a[:, 0::2]), np.ascontiguousarray(a[:, 1::2])
        outs = {v: np.empty((1, n), np.float32) for v in fp4_names}
        copies = [(packed.copy(), scale.copy()) for _ in range(args.cold)]
        calls = itertools.count()

        def weight4():
            return copies[next(calls) % len(copies)]
        runs = {"expand": lambda o: _gemv_fp4_expand(*weight4(), E2M1_PAIR_TABLE, a, o),
                "groups": lambda o: _gemv_fp4_groups(*weight4(), E2M1_PAIR_TABLE, a, o),
                "split": lambda o: _gemv_fp4_split(*weight4(), a_even, a_odd, o)}
        med = _time(runs, outs, args.repeats)
        cyc = {v: med[v] * args.ghz * 1e9 / (n * k) for v in med}
        ref = packed_reference(packed, scale, a)
        close = all(np.allclose(outs[v], ref, rtol=1e-4, atol=1e-3 * np.abs(ref).max()) for v in fp4_names)
        print(f"{shape:>11s} " + " ".join(f"{cyc[v]:13.2f}" for v in fp4_names) + " "
              + " ".join(f"{med[v] / med['split']:12.2f}x" for v in fp4_names[:-1])
              + f"  {'match the fp64 product' if close else 'DIFFER'}", flush=True)


def packed_reference(packed: np.ndarray, scale: np.ndarray, a: np.ndarray) -> np.ndarray:
    """The MXFP4 GEMV in fp64 from the dequantized weight (the variants sum in different orders)."""
    w = np.empty((packed.shape[0], 2 * packed.shape[1]))
    w[:, 0::2], w[:, 1::2] = E2M1_TABLE[packed & 15], E2M1_TABLE[packed >> 4]
    w *= np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)[:, :w.shape[1]]
    return (a.astype(np.float64) @ w.T).astype(np.float32)

if __name__ == "__main__":
    main()
