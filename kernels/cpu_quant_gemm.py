"""CPU GEMMs on FP8 / packed-FP4 weights without materialising the dequantized weight.

Two paths, chosen by the number of activation rows M (per expert for the grouped ops):

* M <= ``GEMV_MAX_ROWS`` (FP8) / ``FP4_GEMV_MAX_ROWS`` (FP4) — decode, and for FP4 short prefills
  too: one numba kernel per op, grouped ops included (every expert with rows in the same call,
  no Python loop). The weight is read once, as stored (1 byte or
  half a byte per element), like llama.cpp's vec_dot kernels. FP8 rows are decoded through IEEE
  half bits (`e4m3_half_bits`, vcvtph2ps) without their scales, which the activations carry
  instead (`_scale_activations`: exact for power-of-two scales), inside the dot product itself
  (`_fp8_dot_rows`: up to four activation rows per pass, the decoded weights never leave registers).
  FP4 rows are decoded once into per-thread fp32 buffers that stay in L1 (the two nibbles of a
  byte through half bits into an even and an odd buffer, no table), then dotted with the M
  activation rows, whose even and odd columns are split once per call.
* larger M (prefill): the tiled path below, where torch's sgemm does the arithmetic.

On the tiled path the weight is walked in N-tiles of about ``TILE_BYTES`` of fp32 (``BF16_TILE_BYTES`` where the
product takes bf16 operands, kernels/cpu_precision.py): numba decodes one tile's codes
and scales into a reused buffer (e4m3 decoded through half bits, e2m1 by a 16-entry table,
times the block scale: exactly the reference's fp32 values, NaN and subnormals included), then one torch ``mm`` multiplies it
into the matching columns of the fp32 output. Peak extra memory is one tile plus the fp32
activation, and the tile stays in cache between its decode and its use. Accumulation is fp32
(torch's sgemm), so results match kernels/reference.py up to summation order.

Activation fake-quantization (``act_quant_fp8``) is a numba row kernel on the branch-free codecs
of kernels/cpu_numerics.py: bit-exact to the reference.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from numba import get_num_threads, njit, prange, types
from numba.extending import overload

from kernels import checks, cpu_gemv
from kernels.cpu_precision import bf16_operands, takes_bf16
from kernels.cpu_numerics import (F32, U8, U16, U32, U64, amax_key, bits_f32, borrow, clamp_inf, e4m3_code,
                                  e4m3_half_bits, f32_bits, half_value, pow2, ue8m0_exponent, ue8m0_value)
from kernels.reference import ACT_GROUP, E2M1_VALUES, FP4_GROUP

TILE_BYTES = 1 << 21     # fp32 weight tile per mm: about a core's L2 (larger tiles help large M)
# The tile where its product takes bf16 operands (kernels/cpu_precision.py): oneDNN then converts
# both operands on every call, the activation once per tile, so fewer, larger tiles pay. On a
# 2-core Xeon with AMX (Emerald Rapids, 2 threads, perf/bench_tile_size.py) 8 MiB tiles ran the
# tiny V4s' FP8 projections at 16-2048 rows 0.98-1.43x as fast as 2 MiB ones (1.2-1.43x on the
# 128-row products of K >= 768), 32 MiB no faster; with exact fp32 operands the same change
# was mixed (0.68-1.39x at 16 rows, 0.97-1.17x beyond), so TILE_BYTES stays for those.
BF16_TILE_BYTES = 1 << 23
# Activation rows (per expert for the grouped ops) up to which the fused row kernels beat tile
# decode + sgemm (perf/bench_quant_gemm.py prints both paths per M). FP8: on a 2-core Xeon they
# won at M <= 4 (1.1-3x) and lost at 16 (0.6x); on an AMD EPYC (Zen 4) 1.9-2.8x at 8, even at
# 16, 0.6x at 32, where sgemm's register blocking pays off (the FP8 kernel decodes each weight
# again for every 4 rows). FP4 decodes a row once into L1 and dots every activation row with
# it, so it keeps winning far longer: on the grouped experts of a 128-token prefill (12-20 rows
# an expert) 1.8-3.2x, still 1.4-1.6x at ~64 rows, since the tiled path pays a Python call,
# a tile decode and a small sgemm per expert.
GEMV_MAX_ROWS = 8
FP4_GEMV_MAX_ROWS = 64
# The fused kernels split their weight rows into about TASKS_PER_THREAD parallel tasks per
# thread (at least ROWS_PER_TASK rows each): enough to balance threads, few enough that the
# buffers each task allocates cost nothing (16-row tasks spent ~25% of a batch-1 GEMV there).
ROWS_PER_TASK = 16
TASKS_PER_THREAD = 4
# Reassociation (and FMA contraction) lets LLVM vectorise the fp32 dot products; unlike full
# fastmath it keeps IEEE NaN / Inf semantics, so a NaN weight or activation still poisons its sums.
_DOT_MATH = {"reassoc", "contract"}
E4M3_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
E2M1_TABLE = torch.cat([E2M1_VALUES, -E2M1_VALUES]).numpy()   # code 8 is -0
_E4M3_MAX = F32(448.0)


# ---- numba kernels ----------------------------------------------------------------------------

def scale_value(s):
    """fp32 value of one scale element: an E8M0 byte (uint8) or an fp32 scale."""


@overload(scale_value)
def _scale_value_impl(s):
    if isinstance(s, types.Integer):
        return lambda s: ue8m0_value(s)
    return lambda s: F32(s)


@njit(cache=True, error_model="numpy", inline="always")
def e4m3_value(code):
    """The value of an e4m3fn byte by integer arithmetic: |v| = mantissa << (exponent − 1) · 2^-9
    with the implicit bit for normals; 0x7F / 0xFF NaN. The previous decode, kept as the
    baseline perf/bench_weight_decode.py measures `e4m3_half_bits` against."""
    b = np.int32(code)
    e = (b >> 3) & 15
    mant = (b & 7) + (8 if e > 0 else 0)
    v = F32(mant << (max(e, 1) - 1)) * F32(2.0**-9)
    v = -v if b >= 128 else v
    return F32(np.nan) if (b & 127) == 127 else v


@njit(cache=True, error_model="numpy")
def e4m3_fast(code):
    """e4m3fn(code) exactly, through `e4m3_half_bits` (× 256 is exact)."""
    return half_value(e4m3_half_bits(code)) * F32(256.0)


@njit(cache=True, error_model="numpy")
def _decode_fp8(src, s, dst):
    for j in range(src.shape[0]):
        dst[j] = e4m3_fast(src[j]) * s


@njit(cache=True, error_model="numpy")
def _decode_fp4(src, table, s, dst):
    for j in range(src.shape[0]):
        b = src[j]
        dst[2 * j] = table[b & 15] * s
        dst[2 * j + 1] = table[b >> 4] * s


@njit(parallel=True, cache=True, error_model="numpy")
def _dequant_fp8_rows(codes_arg, scale_arg, block_n, block_k, row0, out_arg):
    """out[r] = e4m3(codes[r]) * scale[(row0 + r) // block_n, k // block_k]; codes [R, K] u8."""
    codes, scale, out = borrow(codes_arg), borrow(scale_arg), borrow(out_arg)
    k = codes.shape[1]
    for r in prange(codes.shape[0]):
        src, dst, srow = codes[r], out[r], scale[(row0 + r) // block_n]
        for kb in range(srow.shape[0]):
            k0 = kb * block_k
            k1 = min(k0 + block_k, k)
            _decode_fp8(src[k0:k1], scale_value(srow[kb]), dst[k0:k1])


@njit(parallel=True, cache=True, error_model="numpy")
def _dequant_fp4_rows(packed_arg, scale_arg, table_arg, group, out_arg):
    """out[r] = e2m1(nibbles of packed[r]) * scale[r, k // group]; packed [R, K/2] u8."""
    packed, scale, table, out = borrow(packed_arg), borrow(scale_arg), borrow(table_arg), borrow(out_arg)
    pairs, half = packed.shape[1], group // 2
    for r in prange(packed.shape[0]):
        src, dst, srow = packed[r], out[r], scale[r]
        for g in range(srow.shape[0]):
            j0 = g * half
            j1 = min(j0 + half, pairs)
            _decode_fp4(src[j0:j1], table, scale_value(srow[g]), dst[2 * j0:2 * j1])


# ---- fused row kernels (decode): each weight row read once, dotted with every activation row

# Every inner loop runs over a whole row (no loop bounded by a scale block): LLVM vectorises
# those (table lookups as gathers), while block-bounded inner loops measured 3-4x slower.

@njit(cache=True, error_model="numpy")
def _decode_fp8_row(src, dst):
    """dst[k] = e4m3(src[k]) exactly: one weight row, without its scales (the tiled path's and
    perf/bench_weight_decode.py's row decode; the GEMV decodes inside `_fp8_dot_rows`)."""
    for j in range(src.shape[0]):
        dst[j] = e4m3_fast(src[j])


@njit(cache=True, error_model="numpy")
def _scale_activations(a, srow, block_k, dst):
    """dst[i, k] = a[i, k] · scale(srow[k // block_k]) · 256: the activations as one block row of
    weight scales sees them, times the 256 that `e4m3_half_bits` leaves out. The scales are
    powers of two, so half(e4m3 / 256) · (a · s · 256) is the reference's (e4m3 · s) · a exactly
    (every product exact, one rounding), as long as a · s · 256 stays a normal float; the row
    decode then needs no scale, and a row block shares one scaled copy. Unsigned indices from a
    zero-based loop: a signed index starting at kb · block_k gets numba's negative-index select,
    which kept this loop scalar (~1 element a ns on a Zen 4, 8% of a 16-row decode step's
    samples on wide-fp8; 7-11 a ns now; 1.2-1.3x on whole one-row FP8 products)."""
    k = a.shape[1]
    for i in range(a.shape[0]):
        ai, di = a[i], dst[i]
        for kb in range(srow.shape[0]):
            v = scale_value(srow[kb])
            base = U64(kb * block_k)
            for jj in range(min(block_k, k - kb * block_k)):
                j = base + U64(jj)
                di[j] = ai[j] * v * F32(256.0)


@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH)
def _fp8_dot_one_row(codes, r0, r1, scaled, out):
    """out[0, r] = e4m3 row codes[r] · scaled[0] for r in [r0, r1): one activation row (a batch-1
    decode step). Four weight rows per pass share each activation load and keep four weight
    streams in flight: on weights read from L3 or memory, as in a decode step, 1.3-1.5x faster
    than one row per pass (a Xeon, cycling through 24 distinct 8192x256 weights: 0.58 -> 0.40
    ms a call). The four rows are a quarter of the range apart, not adjacent: adjacent rows of
    512 bytes or more put two or more streams in one 4 KiB page, which the hardware prefetchers
    follow badly (on a Zen 4, adjacent rows ran 5.6-7.3 GB/s at K = 512-2048 against 10-13.5
    GB/s a quarter apart, and equal at K = 256; perf/bench_weight_decode.py). Each row's sum
    keeps the one-row loop's vector order (tested)."""
    k = scaled.shape[1]
    q = (r1 - r0) // 4
    for r in range(r0, r0 + q):
        acc0, acc1, acc2, acc3 = F32(0), F32(0), F32(0), F32(0)
        for j in range(k):
            x = scaled[0, j]
            acc0 += half_value(e4m3_half_bits(codes[r, j])) * x
            acc1 += half_value(e4m3_half_bits(codes[r + q, j])) * x
            acc2 += half_value(e4m3_half_bits(codes[r + 2 * q, j])) * x
            acc3 += half_value(e4m3_half_bits(codes[r + 3 * q, j])) * x
        out[0, r], out[0, r + q], out[0, r + 2 * q], out[0, r + 3 * q] = acc0, acc1, acc2, acc3
    for r in range(r0 + 4 * q, r1):
        acc = F32(0)
        for j in range(k):
            acc += half_value(e4m3_half_bits(codes[r, j])) * scaled[0, j]
        out[0, r] = acc


@njit(cache=True, error_model="numpy")
def _fp8_dot_rows(codes, r0, r1, scaled, out):
    """out[i, r] = e4m3 row codes[r] · scaled[i] for r in [r0, r1) (rows sharing one scale block
    row) and every activation row i scaled by `_scale_activations`. Each code is decoded inside
    the dot product (the decoded weights never leave registers: 1.3-1.7x faster than decoding
    the row into a buffer first, perf/bench_weight_decode.py): one activation row through
    `_fp8_dot_one_row`, more through the row kernel every decode-sized product shares
    (`cpu_gemv._dot_rows`: four, two, then one activation row a pass, over tiles of weight rows),
    which reads a code as e4m3 / 256. Every pass gives a row's sum the same vector order, so a
    row's result does not depend on how many rows share the call (tested). One call per row
    block: a call per weight row cost ~40 ns of slicing and call overhead, a third of a K = 256
    row."""
    if scaled.shape[0] == 1:
        _fp8_dot_one_row(codes, r0, r1, scaled, out)
    else:
        cpu_gemv._dot_rows(codes, scaled, r0, r1, out)


@njit(cache=True, error_model="numpy")
def _fp8_rows(codes, scale, block_n, block_k, r0, r1, a, out):
    """out[:, r] for weight rows [r0, r1) of codes [N, K]: one parallel task of the fused FP8
    GEMVs. The activations a [M, K] are scaled once per block row of scales, then that block
    row's weight rows go through `_fp8_dot_rows`."""
    scaled = np.empty(a.shape, np.float32)                      # [M, K]: a as a block row sees it
    r = r0
    while r < r1:
        end = min(r1, (r // block_n + 1) * block_n)
        _scale_activations(a, scale[r // block_n], block_k, scaled)
        _fp8_dot_rows(codes, r, end, scaled, out)
        r = end


@njit(parallel=True, cache=True, error_model="numpy")
def _fp8_gemv(codes_arg, scale_arg, block_n, block_k, a_arg, out_arg, per):
    """out[m, n] = a[m] . (e4m3(codes[n]) * scale[n // block_n]); codes [N, K] u8, a [M, K], out [M, N]."""
    codes, scale = borrow(codes_arg), borrow(scale_arg)
    a, out = borrow(a_arg), borrow(out_arg)
    n = codes.shape[0]
    for task in prange((n + per - 1) // per):
        _fp8_rows(codes, scale, block_n, block_k, task * per, min(n, (task + 1) * per), a, out)


@njit(cache=True, error_model="numpy", inline="always")
def e2m1_half_bits(nibble):
    """IEEE half bits worth e2m1(nibble) / 2^14. e2m1's exponent bias (1) is the half's (15) less
    14, so its exponent and mantissa fields (bits 2..0) moved to the half's bits 11..9 give that
    value for every code, the subnormal 0.5 included (it lands on the half subnormal 2^-15); the
    sign (bit 3) moves to bit 15 (code 8 is -0). Two integer vector ops per code."""
    n = U16(nibble)
    return U16(((n & U16(8)) << U16(12)) | ((n & U16(7)) << U16(9)))


@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH, inline="always")
def _decode_fp4_group(row, j0, n, v, w_even, w_odd):
    """w_even[j], w_odd[j] = the low and high e2m1 of row[j] × v for j in [j0, j0 + n). Unsigned
    indices: a signed one gets numba's negative-index wraparound, a select per element that
    turned these stores into scatters (1.7x slower at batch 1 on a Zen 4)."""
    base = U64(j0)
    for jj in range(n):
        j = base + U64(jj)
        b = row[j]
        w_even[j] = half_value(e2m1_half_bits(b & U8(15))) * v
        w_odd[j] = half_value(e2m1_half_bits(b >> U8(4))) * v


@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH)
def _fp4_dot_rows(packed, scale, r0, r1, group, a_even, a_odd, w_even, w_odd, out):
    """out[i, r] = a[i] · (e2m1(packed[r]) · scale[r, k // group]) for r in [r0, r1) and every
    activation row i, with a's even and odd columns apart (a_even, a_odd [M, K/2]): packed byte
    j holds elements 2j (low nibble) and 2j + 1, so each half of a byte decodes into its own
    buffer (w_even, w_odd [K/2] fp32, per task, in L1) and every loop is a straight vector loop:
    half bits (`e2m1_half_bits`) → vcvtph2ps → × 2^14 × the group's scale (MXFP4's 32 is 16
    bytes, a loop of literal length: one vector each), then the dot products. The decoded
    values are exactly the reference's e2m1 · scale (2^14 and the scale are powers of two; the
    2^14 goes first so a huge scale cannot overflow a value the reference keeps finite). The
    previous kernel looked each byte up in a pair table (gathers) and scaled in a second pass:
    1.7x slower at batch 1 on a Zen 4 (perf/bench_weight_decode.py). The loops sit in this one
    call per task: a call per row cost 1.2-1.4x on expert-sized rows."""
    half, groups = packed.shape[1], scale.shape[1]
    hg = group // 2                                                  # bytes per scale group
    for r in range(r0, r1):
        row = packed[r]
        for g in range(groups):
            v = F32(16384.0) * scale_value(scale[r, g])
            if hg == 16 and half == 16 * groups:
                _decode_fp4_group(row, 16 * g, 16, v, w_even, w_odd)
            else:
                _decode_fp4_group(row, g * hg, min(hg, half - g * hg), v, w_even, w_odd)
        for i in range(a_even.shape[0]):
            acc = F32(0)
            for j in range(half):
                acc += w_even[j] * a_even[i, j] + w_odd[j] * a_odd[i, j]
            out[i, r] = acc


@njit(parallel=True, cache=True, error_model="numpy")
def _fp4_gemv(packed_arg, scale_arg, group, a_even_arg, a_odd_arg, out_arg, per):
    """out[m, n] = a[m] . (e2m1(packed[n]) * scale[n, k // group]); packed [N, K/2] u8, out [M, N];
    a's even and odd columns apart (a_even, a_odd [M, K/2])."""
    packed, scale, a_even, a_odd, out = (borrow(packed_arg), borrow(scale_arg), borrow(a_even_arg),
                                         borrow(a_odd_arg), borrow(out_arg))
    n, half = packed.shape
    for task in prange((n + per - 1) // per):
        _fp4_dot_rows(packed, scale, task * per, min(n, (task + 1) * per), group, a_even, a_odd,
                      np.empty(half, np.float32), np.empty(half, np.float32), out)


@njit(cache=True, error_model="numpy")
def _active_experts(ends, max_rows, rows):
    """(experts with 1..max_rows rows, their first slot, how many experts have more) for ends [E],
    cumulative slot counts over `rows` slots; the count is -1, and no expert active, when ends
    are not non-decreasing within [0, rows]."""
    active, first = np.empty(ends.shape[0], np.int64), np.empty(ends.shape[0], np.int64)
    count, heavy, start = 0, 0, 0
    for e in range(ends.shape[0]):
        if ends[e] < start or ends[e] > rows:
            return active[:0], first[:0], -1
        if start < ends[e] <= start + max_rows:
            active[count], first[count] = e, start
            count += 1
        elif ends[e] > start + max_rows:
            heavy += 1
        start = ends[e]
    return active[:count], first[:count], heavy


@njit(parallel=True, cache=True, error_model="numpy")
def _fp8_grouped_gemv(codes_arg, scale_arg, block_n, block_k, a_arg, ends_arg, max_rows, out_arg, per):
    """Slots [first, ends[e]) of expert e through its weight codes[e] [N, K], for every expert
    with 1..max_rows slots (the others' slots are left as they are); out [S, N]. Parallel over
    (expert, row task) pairs, so the few active experts of a decode step spread over every thread.
    Returns how many experts it left for having more rows (-1: invalid ends, nothing done)."""
    codes, scale = borrow(codes_arg), borrow(scale_arg)
    a, out = borrow(a_arg), borrow(out_arg)
    n = codes.shape[1]
    active, first, heavy = _active_experts(borrow(ends_arg), max_rows, a.shape[0])
    per = min(n, per)
    tasks = (n + per - 1) // per
    for t in prange(active.shape[0] * tasks):
        e, task = active[t // tasks], t % tasks
        _fp8_rows(codes[e], scale[e], block_n, block_k, task * per, min(n, (task + 1) * per),
                  a[first[t // tasks]:ends_arg[e]], out[first[t // tasks]:ends_arg[e]])
    return heavy


@njit(parallel=True, cache=True, error_model="numpy")
def _fp4_grouped_gemv(packed_arg, scale_arg, group, a_even_arg, a_odd_arg, ends_arg, max_rows, out_arg, per):
    """As _fp8_grouped_gemv for packed e2m1 experts [E, N, K/2] with per-row group scales; a's
    even and odd columns apart as in _fp4_gemv. Returns as _fp8_grouped_gemv."""
    packed, scale, a_even, a_odd, out = (borrow(packed_arg), borrow(scale_arg), borrow(a_even_arg),
                                         borrow(a_odd_arg), borrow(out_arg))
    n, half = packed.shape[1], packed.shape[2]
    active, first, heavy = _active_experts(borrow(ends_arg), max_rows, a_even.shape[0])
    per = min(n, per)
    tasks = (n + per - 1) // per
    for t in prange(active.shape[0] * tasks):
        e, task = active[t // tasks], t % tasks
        rows = slice(first[t // tasks], ends_arg[e])
        _fp4_dot_rows(packed[e], scale[e], task * per, min(n, (task + 1) * per), group, a_even[rows], a_odd[rows],
                      np.empty(half, np.float32), np.empty(half, np.float32), out[rows])
    return heavy


@njit(cache=True, error_model="numpy")
def _fake_quant_group(src, table, dst):
    """One activation group, as reference._act_quant_f32: NaN ignored by amax, Inf as FLT_MAX."""
    amax = U32(0)
    for j in range(src.shape[0]):
        amax = max(amax, amax_key(f32_bits(src[j])))
    s = pow2(ue8m0_exponent(amax, _E4M3_MAX))
    for j in range(src.shape[0]):
        y = F32(bits_f32(clamp_inf(f32_bits(src[j]))) / s)
        dst[j] = table[e4m3_code(f32_bits(y))] * s


@njit(parallel=True, cache=True, error_model="numpy")
def _act_quant_rows(x_arg, group, table_arg, out_arg):
    x, table, out = borrow(x_arg), borrow(table_arg), borrow(out_arg)
    k = x.shape[1]
    for r in prange(x.shape[0]):
        src, dst = x[r], out[r]
        for g0 in range(0, k, group):
            g1 = min(g0 + group, k)
            _fake_quant_group(src[g0:g1], table, dst[g0:g1])


# ---- torch drivers ----------------------------------------------------------------------------

def _np(t: torch.Tensor) -> np.ndarray:
    """numpy view of a CPU tensor; fp8 / e8m0 / int8 codes are read as uint8."""
    t = t.contiguous()
    if t.dtype != torch.float32:
        t = t.view(torch.uint8)
    return t.numpy()


def _act_f32(x: torch.Tensor, group: int) -> torch.Tensor:
    """Fake-quantized fp32 copy of x [M, K]."""
    xf = x.float().contiguous()
    out = torch.empty_like(xf)
    if xf.numel():
        _act_quant_rows(xf.numpy(), group, E4M3_TABLE, out.numpy())
    return out


def act_quant_fp8(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    checks.check_act_quant(x, group)
    if x.numel() == 0:
        return x.clone()
    return _act_f32(x.reshape(-1, x.shape[-1]), group).reshape(x.shape).to(x.dtype)


def _activation(x: torch.Tensor, act_quant: bool, act_group: int) -> torch.Tensor:
    return _act_f32(x, act_group) if act_quant else x.float().contiguous()


def _split_columns(a: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """a fp32 [M, K] (K even) -> its even and odd columns, each [M, K/2]: the FP4 row kernels'
    activations (a packed byte holds elements 2j and 2j + 1). numpy's strided copies: two torch
    ops cost ~15 us at decode sizes, these ~2 us."""
    an = a.numpy()
    return np.ascontiguousarray(an[:, 0::2]), np.ascontiguousarray(an[:, 1::2])


def _rows_per_task(rows: int) -> int:
    """Weight rows per parallel task of a fused kernel doing `rows` weight rows of work."""
    return max(ROWS_PER_TASK, -(-rows // (TASKS_PER_THREAD * get_num_threads())))


def _tiled_mm(a: torch.Tensor, n: int, row_align: int, dequant: Callable[[int, int, np.ndarray], None]) -> torch.Tensor:
    """a fp32 [M, K] @ W^T for W [N, K] produced tile by tile by dequant(n0, n1, buf) -> fp32 [M, N].
    Each tile's product lands in its column slice of the output (sgemm with ldc = N), so the
    result needs no transposing copy (that copy took ~7% of a 2048-token prefill)."""
    m, k = a.shape
    out = torch.empty(m, n)                                 # [M, N]
    rows = _tile_rows(m, n, k, row_align)
    buf = torch.empty(min(rows, n), k)                      # [rows, K]
    with bf16_operands(m * k * min(rows, n)):               # kernels/cpu_precision.py: one tile's product
        for n0 in range(0, n, rows):
            n1 = min(n0 + rows, n)
            tile = buf[:n1 - n0]
            dequant(n0, n1, tile.numpy())
            torch.mm(a, tile.T, out=out[:, n0:n1])
    return out


def _tile_rows(m: int, n: int, k: int, row_align: int) -> int:
    """Weight rows per tile of an [M, K] @ [N, K]^T tiled product: a multiple of row_align about
    BF16_TILE_BYTES of fp32 where that tile's product takes bf16 operands, else TILE_BYTES."""
    def rows_in(tile_bytes: int) -> int:
        return max(row_align, tile_bytes // (4 * max(k, 1)) // row_align * row_align)
    large = rows_in(BF16_TILE_BYTES)
    return large if takes_bf16(m * k * min(large, n)) else rows_in(TILE_BYTES)


def _fp8_mm(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """a fp32 [M, K] @ dequant(weight)^T -> fp32 [M, N]."""
    codes, s = _np(weight), _np(scale)
    bn, bk = block
    if a.shape[0] == 0:
        return torch.empty(0, weight.shape[0])
    if a.shape[0] <= GEMV_MAX_ROWS:
        out = torch.empty(a.shape[0], weight.shape[0])        # [M, N]
        _fp8_gemv(codes, s, bn, bk, a.numpy(), out.numpy(), _rows_per_task(weight.shape[0]))
        return out

    def dequant(n0: int, n1: int, buf: np.ndarray) -> None:
        _dequant_fp8_rows(codes[n0:n1], s, bn, bk, n0, buf)
    return _tiled_mm(a, weight.shape[0], bn, dequant)


def _fp4_mm(a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """a fp32 [M, K] @ dequant(packed)^T -> fp32 [M, N]."""
    pairs, s = _np(packed), _np(scale)
    if a.shape[0] == 0:
        return torch.empty(0, packed.shape[0])
    if a.shape[0] <= FP4_GEMV_MAX_ROWS:
        out = torch.empty(a.shape[0], packed.shape[0])
        _fp4_gemv(pairs, s, group, *_split_columns(a), out.numpy(), _rows_per_task(packed.shape[0]))
        return out

    def dequant(n0: int, n1: int, buf: np.ndarray) -> None:
        _dequant_fp4_rows(pairs[n0:n1], s[n0:n1], E2M1_TABLE, group, buf)
    return _tiled_mm(a, packed.shape[0], 1, dequant)


def _finish(out: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """fp32 [M, N] -> a contiguous out_dtype [M, N], one copy at most."""
    if out.dtype == out_dtype and out.is_contiguous():
        return out
    return torch.empty(out.shape, dtype=out_dtype).copy_(out)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
               act_quant: bool = False, out_dtype: torch.dtype | None = None,
               act_group: int = ACT_GROUP) -> torch.Tensor:
    checks.check_fp8_gemm("fp8_linear", x, weight, scale, block, None, out_dtype, act_group)
    a = _activation(x, act_quant, act_group)
    return _finish(_fp8_mm(a, weight, scale, tuple(block)), out_dtype or x.dtype)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, act_quant: bool = False,
               out_dtype: torch.dtype | None = None, group: int = FP4_GROUP,
               act_group: int = ACT_GROUP) -> torch.Tensor:
    checks.check_fp4_gemm("fp4_linear", x, packed, scale, group, None, out_dtype, act_group)
    a = _activation(x, act_quant, act_group)
    return _finish(_fp4_mm(a, packed, scale, group), out_dtype or x.dtype)


def _grouped(a: torch.Tensor, n: int, offsets: torch.Tensor, out_dtype: torch.dtype, max_rows: int,
             fused: Callable[[np.ndarray, int, int, np.ndarray], None],
             expert_mm: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """Expert e's rows [offsets[e-1], offsets[e]) of a fp32 [S, K] through expert e -> [S, N];
    experts without rows are never decoded; rows past offsets[-1] stay zero. One fused call
    fused(ends, max_rows, out) does every expert with at most `max_rows` rows (all of them in
    a decode step); expert_mm(rows, e) -> fp32 [rows, N] does each expert with more (the tiled
    path), so a batch where a few experts are popular still decodes the rest in one call (its
    third argument: how many experts that call decodes)."""
    ends = offsets.to(torch.int64).numpy()
    out = torch.zeros(a.shape[0], n)                        # [S, N] fp32
    if not a.shape[0]:
        return _finish(out, out_dtype)
    counts = ends.copy()
    counts[1:] -= ends[:-1]                                 # rows per expert (np.diff: 5x the cost)
    light = int(np.count_nonzero((counts > 0) & (counts <= max_rows)))
    if light:
        fused(ends, max_rows, light, out.numpy())
    for e in np.flatnonzero(counts > max_rows).tolist():
        start, end = int(ends[e] - counts[e]), int(ends[e])
        out[start:end] = expert_mm(a[start:end], e)
    return _finish(out, out_dtype)


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   block: tuple[int, int] = (128, 128), act_quant: bool = False,
                   out_dtype: torch.dtype | None = None, act_group: int = ACT_GROUP) -> torch.Tensor:
    checks.check_fp8_gemm("fp8_grouped_mm", x, weight, scale, block, offsets, out_dtype, act_group)
    a = _activation(x, act_quant, act_group)
    bn, bk = block

    def fused(ends: np.ndarray, max_rows: int, light: int, out: np.ndarray) -> None:
        _fp8_grouped_gemv(_np(weight), _np(scale), bn, bk, a.numpy(), ends, max_rows, out,
                          _rows_per_task(weight.shape[1] * light))
    return _grouped(a, weight.shape[1], offsets, out_dtype or x.dtype, GEMV_MAX_ROWS, fused,
                    lambda rows, e: _fp8_mm(rows, weight[e], scale[e], (bn, bk)))


def fp4_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   act_quant: bool = False, out_dtype: torch.dtype | None = None, group: int = FP4_GROUP,
                   act_group: int = ACT_GROUP) -> torch.Tensor:
    checks.check_fp4_gemm("fp4_grouped_mm", x, packed, scale, group, offsets, out_dtype, act_group)
    a = _activation(x, act_quant, act_group)

    def fused(ends: np.ndarray, max_rows: int, light: int, out: np.ndarray) -> None:
        _fp4_grouped_gemv(_np(packed), _np(scale), group, *_split_columns(a), ends, max_rows, out,
                          _rows_per_task(packed.shape[1] * light))
    return _grouped(a, packed.shape[1], offsets, out_dtype or x.dtype, FP4_GEMV_MAX_ROWS, fused,
                    lambda rows, e: _fp4_mm(rows, packed[e], scale[e], group))
