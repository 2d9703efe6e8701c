"""Triton GEMMs on stored FP8 / packed-FP4 weights, dequantized tile by tile in registers.

Each program owns a BM x BN output tile and walks K in BK steps: it loads the activation tile,
the weight's e4m3 codes (or packed e2m1 bytes, each byte read for both of its nibbles) and the
matching scale of every element, decodes codes and E8M0 scales with integer bit operations (no
fp8 dtypes, no subnormal arithmetic: the same code runs compiled and under the interpreter),
and accumulates ``tl.dot`` in fp32. Masked-off elements load code 0 and a finite scale, so a
NaN scale of a ragged last block never leaks into the padding.

Dot precision: dequantized weights (a 4-bit or 2-bit significand times a power of two) and
fake-quantized activations are exact in bf16, so on a GPU the dot takes bf16 operands whenever
the activation is bf16 or fake-quantized (exact products, fp32 sums) and fp32 "ieee" operands
otherwise. The interpreter always takes fp32: its bf16 dot is wrong (it multiplies the raw
uint16 bit patterns). bf16 outputs are rounded by bit operations (RNE, NaN -> 0x7FC0) for the
same reason (the interpreter's float -> bf16 cast does not round to nearest even).

Grouped GEMMs (MoE) run a grid of (M tiles, N tiles) where the M axis has an upper bound of
cdiv(S, BM) + E tiles: each program scans the offsets (a vector load and a cumsum, no host
sync) to find its expert and row range, and a program past the last tile has no K loop. Rows
at or past offsets[-1] belong to no expert and stay zero. Offsets are clamped to [0, S], so
invalid offsets give wrong rows but never out-of-bounds accesses.

Activation fake-quantization (``act_quant_fp8``) is its own kernel: one program per
(16 rows, one group), bit-exact to kernels/reference.py (``div_rn`` for the scale's quotient).
GPU-only caveat: fp32 subnormals may be flushed to zero by the compiled code, so E8M0 scale
byte 0 (the subnormal 2^-127) and weight values below 2^-126 (scale bytes below 10) can decode
to 0 there; the interpreter, like the reference, computes them exactly. Real checkpoints do not
use such scales (an all-zero block gets 2^-22 or 1).
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from kernels import checks
from kernels.reference import ACT_GROUP, FP4_GROUP

FLT_MAX = tl.constexpr(3.4028234663852886e38)
INTERPRET_TILES = (16, 16, 32)        # (BM, BN, BK) under TRITON_INTERPRET: tiny, several tiles per test
ACT_ROWS = 16
GEMM_WARPS = 8                        # see _tiles
OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# ---- element codecs (int32 in, fp32 out) -------------------------------------------------------

@triton.jit
def _pow2(e):
    """2^e as fp32 for int32 e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(c):
    """e4m3fn code (0..255) -> fp32, exact; 0x7F / 0xFF -> NaN, 0x80 -> -0."""
    e = (c >> 3) & 15
    m = c & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (m + 8).to(tl.float32) * _pow2(e - 10))
    mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def _e2m1_value(c):
    """e2m1 code (0..15) -> fp32, exact; code 8 is -0."""
    e = (c >> 1) & 3
    m = c & 1
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, (m + 2).to(tl.float32) * _pow2(e - 2))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _scale(ptrs, mask, SCALE_F32: tl.constexpr):
    """Scales at ptrs: fp32, or E8M0 bytes 2^(b-127) (0 -> the subnormal 2^-127, 0xFF -> NaN).
    Masked-off scales are finite (0, or byte 0), so with their code 0 they dequantize to 0."""
    if SCALE_F32:
        return tl.load(ptrs, mask=mask, other=0.0)
    b = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
    v = tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), v)


@triton.jit
def _round_e4m3(y):
    """fp32 -> the nearest e4m3fn value as fp32 (RNE, saturating at +-448, sign kept; NaN kept)."""
    u = y.to(tl.uint32, bitcast=True)
    a = tl.minimum(u & 0x7FFFFFFF, 0x43E00000)                      # |y| capped at 448
    normal = (a + 0x7FFFF + ((a >> 20) & 1)) & 0xFFF00000            # 3 mantissa bits, RNE
    sub = ((a.to(tl.float32, bitcast=True) + 16384.0) - 16384.0).to(tl.uint32, bitcast=True)  # 2^-9 steps
    r = tl.where(a < 0x3C800000, sub, normal) | (u & 0x80000000)     # below 2^-6: subnormal grid
    r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, u, r)
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _fake_quant_e4m3(x):
    """x [R, G] fp32 -> per-row fake-quantized e4m3 with s = 2^ceil(log2(max(amax, 1e-4)/448))."""
    key = tl.where(x != x, 0.0, tl.minimum(tl.abs(x), FLT_MAX))      # NaN ignored, Inf as FLT_MAX
    ratio = tl.math.div_rn(tl.maximum(tl.max(key, axis=1), 1e-4), 448.0)
    u = ratio.to(tl.uint32, bitcast=True)
    e = (u >> 23).to(tl.int32) - 127 + ((u & 0x7FFFFF) != 0).to(tl.int32)   # ceil(log2(ratio))
    xc = tl.where(x != x, x, tl.minimum(tl.maximum(x, -FLT_MAX), FLT_MAX))
    return _round_e4m3(xc * _pow2(-e)[:, None]) * _pow2(e)[:, None]


# ---- tile loads and stores --------------------------------------------------------------------

@triton.jit
def _load_act(ptrs, mask, X_BF16: tl.constexpr):
    """Activation tile as fp32; bf16 arrives as int16 bits and is widened by a shift."""
    if X_BF16:
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(ptrs, v, mask, OUT_KIND: tl.constexpr):
    """Store fp32 v as fp32 (0), bf16 bits into an int16 view (1, RNE, NaN -> 0x7FC0) or fp16 (2)."""
    if OUT_KIND == 1:
        u = v.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        tl.store(ptrs, r.to(tl.int16), mask=mask)
    elif OUT_KIND == 2:
        tl.store(ptrs, v.to(tl.float16), mask=mask)
    else:
        tl.store(ptrs, v, mask=mask)


@triton.jit
def _fp8_tile(w_ptr, s_ptr, cols, ks, mask, stride_wn, stride_sn, QN: tl.constexpr, QK: tl.constexpr,
              SCALE_F32: tl.constexpr):
    """Dequantized weight tile [BN, BK]: e4m3 code * scale[n // QN, k // QK]."""
    c = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=mask, other=0).to(tl.int32)
    s = _scale(s_ptr + (cols // QN)[:, None] * stride_sn + (ks // QK)[None, :], mask, SCALE_F32)
    return _e4m3_value(c) * s


@triton.jit
def _fp4_tile(p_ptr, s_ptr, cols, ks, mask, stride_wn, stride_sn, QK: tl.constexpr, SCALE_F32: tl.constexpr):
    """Dequantized weight tile [BN, BK]: nibble k & 1 of byte k // 2 (low = even k) * scale[n, k // QK]."""
    byte = tl.load(p_ptr + cols[:, None] * stride_wn + (ks // 2)[None, :], mask=mask, other=0).to(tl.int32)
    nibble = (byte >> ((ks & 1) * 4)[None, :]) & 15
    s = _scale(s_ptr + cols[:, None] * stride_sn + (ks // QK)[None, :], mask, SCALE_F32)
    return _e2m1_value(nibble) * s


@triton.jit
def _expert_tile(offs_ptr, pid, num_experts, rows, E_POW2: tl.constexpr, BM: tl.constexpr):
    """(expert, first row, end row) of M tile ``pid``: experts' tiles are numbered in expert order,
    cdiv(count_e, BM) each. Past the last tile the row range is empty."""
    e = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + e, mask=e < num_experts, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=(e >= 1) & (e < num_experts), other=0)
    ends = tl.minimum(tl.maximum(ends, 0), rows)
    starts = tl.minimum(tl.maximum(starts, 0), rows)
    tiles = (tl.maximum(ends - starts, 0) + BM - 1) // BM
    last = tl.cumsum(tiles, axis=0)                                  # inclusive tile ends
    expert = tl.sum((last <= pid).to(tl.int32), axis=0)               # first e with last[e] > pid
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, last - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(mine, starts, 0), axis=0) + (pid - first_tile) * BM
    return expert, row0, tl.sum(tl.where(mine, ends, 0), axis=0)


@triton.jit
def _quant_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, offs_ptr, M, N, K, num_experts,
                       stride_xm, stride_om, stride_we, stride_wn, stride_se, stride_sn,
                       FP4: tl.constexpr, GROUPED: tl.constexpr, QN: tl.constexpr, QK: tl.constexpr,
                       SCALE_F32: tl.constexpr, X_BF16: tl.constexpr, OUT_KIND: tl.constexpr,
                       DOT_BF16: tl.constexpr, E_POW2: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        expert, row0, row_end = _expert_tile(offs_ptr, pid_m, num_experts, M, E_POW2, BM)
        w_ptr += expert.to(tl.int64) * stride_we
        s_ptr += expert.to(tl.int64) * stride_se
    else:
        row0 = pid_m * BM
        row_end = M
    k_end = tl.where(row0 < row_end, K, 0)                            # no K loop for an empty tile
    rows = row0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < row_end
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k_end, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        a = _load_act(x_ptr + rows64[:, None] * stride_xm + ks[None, :], row_ok[:, None] & k_ok[None, :], X_BF16)
        w_ok = col_ok[:, None] & k_ok[None, :]
        if FP4:
            w = _fp4_tile(w_ptr, s_ptr, cols64, ks, w_ok, stride_wn, stride_sn, QK, SCALE_F32)
        else:
            w = _fp8_tile(w_ptr, s_ptr, cols64, ks, w_ok, stride_wn, stride_sn, QN, QK, SCALE_F32)
        if DOT_BF16:
            acc = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    _store(out_ptr + rows64[:, None] * stride_om + cols64[None, :], acc, row_ok[:, None] & col_ok[None, :], OUT_KIND)


@triton.jit
def _act_quant_kernel(x_ptr, out_ptr, M, K, stride_xm, stride_om, X_BF16: tl.constexpr,
                      OUT_KIND: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    ks = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    mask = (rows < M)[:, None] & (ks < K)[None, :]
    x = _load_act(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask, X_BF16)   # padding 0: amax unchanged
    _store(out_ptr + rows[:, None] * stride_om + ks[None, :], _fake_quant_e4m3(x), mask, OUT_KIND)


# ---- launch wrappers --------------------------------------------------------------------------

def _device(t: torch.Tensor):
    """Launch on t's GPU (Triton uses torch's current device and its current stream)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """What a kernel reads or writes: bf16 as int16 bits, fp8/e8m0/int8 codes as uint8."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8):
        return t.view(torch.uint8)
    return t


def _interpreted() -> bool:
    """Under TRITON_INTERPRET (CPU tensors): tiny tiles, fp32 dots. Decided by the mode, not the
    tensors' device, so a launch recorded from meta or fake tensors is the GPU's."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _tiles(m: int, bf16_dot: bool) -> tuple[int, int, int]:
    """(BM, BN, BK). The dequantized [BN, BK] weight tile (codes, scales, values) dominates the
    registers: at 8 warps a 64 x 64 tile fits beside a bf16 tensor-core dot, while an fp32 FMA dot
    (each thread holds whole BK rows of both operands) needs BK = 32 to compile without spills."""
    if _interpreted():
        return INTERPRET_TILES
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    return bm, 64, 64 if bf16_dot else 32


def _act_quant_into(x: torch.Tensor, out: torch.Tensor, group: int) -> None:
    """x [M, K] (unit stride along K) -> out [M, K], any of the float dtypes."""
    m, k = x.shape
    grid = (triton.cdiv(m, ACT_ROWS), triton.cdiv(k, group))
    _act_quant_kernel[grid](_bits(x), _bits(out), m, k, x.stride(0), out.stride(0),
                            X_BF16=x.dtype == torch.bfloat16, OUT_KIND=OUT_KINDS[out.dtype],
                            ROWS=ACT_ROWS, GROUP=group)


def act_quant_fp8(x: torch.Tensor, group: int = ACT_GROUP, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fake-quantize x [..., K] (see reference.act_quant_fp8); the result in out_dtype (default x.dtype)."""
    checks.check_act_quant(x, group)
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if x.numel():
        with _device(x):
            _act_quant_into(x.reshape(-1, x.shape[-1]).contiguous(), out.view(-1, x.shape[-1]), group)
    return out


def _gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor | None,
          fp4: bool, qn: int, qk: int, act_quant: bool, act_group: int, out_dtype: torch.dtype) -> torch.Tensor:
    m, n = x.shape[0], weight.shape[-2]
    grouped = offsets is not None
    experts = weight.shape[0] if grouped else 1
    with _device(x):
        # Fake-quantized values (e4m3 times a power of two) are exact in bf16.
        a = act_quant_fp8(x, act_group, torch.bfloat16) if act_quant else x.contiguous()
        out = (torch.zeros if grouped else torch.empty)((m, n), dtype=out_dtype, device=x.device)
        bf16_dot = not _interpreted() and a.dtype == torch.bfloat16
        bm, bn, bk = _tiles(m, bf16_dot)
        tiles_m = triton.cdiv(m, bm) + (experts if grouped else 0)
        if m == 0 or n == 0 or experts == 0:
            return out
        w, s = _bits(weight.contiguous()), _bits(scale.contiguous())
        offs = offsets.to(torch.int32).contiguous() if grouped else w
        _quant_gemm_kernel[(tiles_m, triton.cdiv(n, bn))](
            _bits(a), w, s, _bits(out), offs, m, n, x.shape[1], experts,
            a.stride(0), out.stride(0), w.stride(0) if grouped else 0, w.stride(-2),
            s.stride(0) if grouped else 0, s.stride(-2),
            FP4=fp4, GROUPED=grouped, QN=qn, QK=qk, SCALE_F32=scale.dtype == torch.float32,
            X_BF16=a.dtype == torch.bfloat16, OUT_KIND=OUT_KINDS[out_dtype],
            DOT_BF16=bf16_dot, E_POW2=triton.next_power_of_2(experts), BM=bm, BN=bn, BK=bk, num_warps=GEMM_WARPS)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
               act_quant: bool = False, out_dtype: torch.dtype | None = None,
               act_group: int = ACT_GROUP) -> torch.Tensor:
    checks.check_fp8_gemm("fp8_linear", x, weight, scale, block, None, out_dtype, act_group)
    return _gemm(x, weight, scale, None, False, block[0], block[1], act_quant, act_group, out_dtype or x.dtype)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, act_quant: bool = False,
               out_dtype: torch.dtype | None = None, group: int = FP4_GROUP,
               act_group: int = ACT_GROUP) -> torch.Tensor:
    checks.check_fp4_gemm("fp4_linear", x, packed, scale, group, None, out_dtype, act_group)
    return _gemm(x, packed, scale, None, True, 1, group, act_quant, act_group, out_dtype or x.dtype)


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   block: tuple[int, int] = (128, 128), act_quant: bool = False,
                   out_dtype: torch.dtype | None = None, act_group: int = ACT_GROUP) -> torch.Tensor:
    checks.check_fp8_gemm("fp8_grouped_mm", x, weight, scale, block, offsets, out_dtype, act_group)
    return _gemm(x, weight, scale, offsets, False, block[0], block[1], act_quant, act_group, out_dtype or x.dtype)


def fp4_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   act_quant: bool = False, out_dtype: torch.dtype | None = None, group: int = FP4_GROUP,
                   act_group: int = ACT_GROUP) -> torch.Tensor:
    checks.check_fp4_gemm("fp4_grouped_mm", x, packed, scale, group, offsets, out_dtype, act_group)
    return _gemm(x, packed, scale, offsets, True, 1, group, act_quant, act_group, out_dtype or x.dtype)
