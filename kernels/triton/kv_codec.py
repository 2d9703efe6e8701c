"""KV record codecs as Triton device functions: decode a key tile, encode one record, in registers.

The fused decode kernels read paged pools without dequantized copies and write compressed
entries without a separate quantize pass; this module holds the byte-level rules they share,
bit for bit those of ``kernels/formats.py`` (every element decode and encode is integer bit
arithmetic, never a hardware fp8 conversion, so the compiled kernels and the interpreter agree).
``quantize_scatter`` / ``gather_dequantize`` here are thin test kernels over the same helpers,
checked against ``kernels.reference`` exactly.

Format codes (constexpr ``FMT``): RAW (the pool holds bf16/fp16/fp32 values), FP8_DS_MLA,
FP4_KV, FP4_INDEX. Pools are ``[num_blocks, R, record_bytes]`` uint8 (raw: ``[.., R, D]``);
slot = block * R + offset; fp8_ds_mla splits a block into all R data parts then all R scale parts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# The pool layout is pure Python (kernels/pool_layout.py); re-exported for the kernels here.
from kernels.pool_layout import (_CODES, FP4_INDEX, FP4_KV, FP8_DS_MLA, RAW, RAW_DTYPES, PoolArgs,  # noqa: F401
                                 check_dim, pair_group, pool_args, pool_constexprs)



# ---- scalar bit helpers ---------------------------------------------------------------------

@triton.jit
def _nan_f32():
    return tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _pow2(exponent):
    """2^exponent as fp32 for integer exponent in [-126, 127] (exact)."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rint_small(v):
    """Round-half-even of 0 <= v < 2^22 to an integral fp32: adding 2^23 leaves no fraction bits."""
    return (v + 8388608.0) - 8388608.0


# ---- element decoders (int32 codes -> fp32) ---------------------------------------------------

@triton.jit
def e4m3_decode(code):
    """e4m3fn byte -> fp32; 0x7F/0xFF are NaN, exponent 0 is subnormal (m * 2^-9)."""
    sign = (code >> 7) & 1
    exp = (code >> 3) & 15
    man = code & 7
    normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125
    sub = tl.where(sign == 1, -sub, sub)
    value = tl.where(exp == 0, sub, normal)
    return tl.where((code & 127) == 127, _nan_f32(), value)


@triton.jit
def e2m1_decode(code):
    """e2m1 nibble -> fp32: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign."""
    exp = (code >> 1) & 3
    man = (code & 1).to(tl.float32)
    mag = tl.where(exp == 0, man * 0.5, (2.0 + man) * _pow2(exp - 2))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def ue8m0_decode(code):
    """ue8m0 byte -> 2^(code - 127); 0xFF is NaN; 0 is the subnormal 2^-127."""
    value = (code << 23).to(tl.float32, bitcast=True)
    value = tl.where(code == 0, tl.full([], 0x00400000, tl.int32).to(tl.float32, bitcast=True), value)
    return tl.where(code == 255, _nan_f32(), value)


@triton.jit
def bf16_decode(lo, hi):
    """Little-endian bf16 bytes -> fp32 (exact)."""
    return ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)


# ---- element encoders (fp32 -> int32 codes) ---------------------------------------------------

@triton.jit
def _sign_bit(x):
    return (x.to(tl.int32, bitcast=True) >> 31) & 1


@triton.jit
def e4m3_encode(y):
    """fp32 -> e4m3fn byte: RNE, saturating at +-448, sign kept (tiny negatives -> 0x80); NaN -> 0x7F."""
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range: round the 23-bit mantissa to 3 bits (half to even), rebias 127 -> 7.
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    # Below 2^-6 the quantum is 2^-9: the code is the rounded multiple (8 is the smallest normal).
    sub = _rint_small(a * 512.0).to(tl.int32)
    mag = tl.where(a < 0.015625, sub, normal)
    return tl.where(y != y, 0x7F, mag | (_sign_bit(y) << 7))


@triton.jit
def e2m1_encode(y):
    """fp32 (NaN already read as 0) -> e2m1 nibble: RNE (ties to the even code), saturating at 6."""
    a = tl.abs(y)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    return mag | (_sign_bit(y) << 3)


@triton.jit
def ue8m0_exponent(amax, qmax: tl.constexpr):
    """ceil(log2(max(amax, 1e-4) / qmax)), exact from the fp32 quotient's bits (always normal)."""
    ratio = tl.maximum(amax, 1e-4) / qmax
    bits = ratio.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 255) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def bf16_encode(x):
    """fp32 -> bf16 bits (RNE; Inf kept; every NaN -> 0x7FC0) as int32 in [0, 65535]."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(x != x, 0x7FC0, rounded)


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (RNE), as fp32. Triton's interpreter truncates in
    .to(tl.bfloat16), so every bf16 rounding goes through this (exact either way afterwards)."""
    return (bf16_encode(x) << 16).to(tl.float32, bitcast=True)


@triton.jit
def cast(x, dtype: tl.constexpr):
    """fp32 -> ``dtype`` with round-to-nearest-even on the compiled and interpreted paths alike."""
    if dtype == tl.bfloat16:
        x = round_bf16(x)
    return x.to(dtype)


# ---- record addressing ------------------------------------------------------------------------

@triton.jit
def record_offsets(slot, R: tl.constexpr, REC: tl.constexpr, DATA: tl.constexpr, SCALES: tl.constexpr,
                   SPLIT: tl.constexpr):
    """Byte offsets (data, scales) of int64 ``slot`` (formats.slot_offsets)."""
    if SPLIT:
        base = (slot // R) * (R * REC)
        data = base + (slot % R) * DATA
        scale = base + R * DATA + (slot % R) * SCALES
    else:
        data = slot * REC
        scale = data + DATA
    return data, scale


# ---- tile decode: [N] slots -> [N, W] fp32 ----------------------------------------------------

@triton.jit
def load_keys(pool, slots, valid, D: tl.constexpr, FMT: tl.constexpr, R: tl.constexpr, REC: tl.constexpr,
              DATA: tl.constexpr, SCALES: tl.constexpr, NOPE: tl.constexpr, GROUP: tl.constexpr):
    """Dequantize the records of ``slots`` [N] (``valid`` [N]) into fp32 [N, D]; invalid rows are 0."""
    return load_key_cols(pool, slots, valid, 0, D, D, FMT, R, REC, DATA, SCALES, NOPE, GROUP)


@triton.jit
def load_key_cols(pool, slots, valid, c0, W: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, R: tl.constexpr,
                  REC: tl.constexpr, DATA: tl.constexpr, SCALES: tl.constexpr, NOPE: tl.constexpr,
                  GROUP: tl.constexpr):
    """Columns c0 .. c0 + W - 1 of the records of ``slots`` [N] (``valid`` [N]) as fp32 [N, W],
    invalid rows 0; c0 a multiple of W (a constexpr c0 lets the compiler drop the loads of a
    format part the columns do not reach).

    Invalid rows issue no loads, so whatever an unused slot holds (NaN included) cannot leak in.
    """
    cols = c0 + tl.arange(0, W)[None, :]                          # [1, W]
    s = tl.where(valid, slots, 0).to(tl.int64)[:, None]           # [N, 1]
    v = valid[:, None]
    if FMT == 0:
        values = tl.load(pool + s * D + cols, mask=v, other=0.0).to(tl.float32)
    else:
        data, scale = record_offsets(s, R, REC, DATA, SCALES, FMT == 1)
        if FMT == 1:  # fp8_ds_mla: e4m3 nope codes * ue8m0 per 64, then 64 bf16 rope values
            is_nope = cols < NOPE
            code = tl.load(pool + data + cols, mask=v & is_nope, other=0).to(tl.int32)
            sc = tl.load(pool + scale + cols // GROUP, mask=v & is_nope, other=0).to(tl.int32)
            j = tl.maximum(cols - NOPE, 0)
            lo = tl.load(pool + data + NOPE + 2 * j, mask=v & ~is_nope, other=0).to(tl.int32)
            hi = tl.load(pool + data + NOPE + 2 * j + 1, mask=v & ~is_nope, other=0).to(tl.int32)
            values = tl.where(is_nope, e4m3_decode(code) * ue8m0_decode(sc), bf16_decode(lo, hi))
        else:  # fp4: two e2m1 codes per byte (even element low), a scale per GROUP after the codes
            byte = tl.load(pool + data + cols // 2, mask=v, other=0).to(tl.int32)
            code = tl.where((cols & 1) == 1, byte >> 4, byte & 15)
            sc = tl.load(pool + data + D // 2 + cols // GROUP, mask=v, other=0).to(tl.int32)
            if FMT == 2:
                scale_value = e4m3_decode(sc)
            else:
                scale_value = ue8m0_decode(sc)
            values = e2m1_decode(code) * scale_value
    return tl.where(v, values, 0.0)


# ---- record encode: one vector in pair layout -> pool -----------------------------------------

@triton.jit
def _group_amax(xe, xo):
    """Per-group amax [NG] of a pair tile, NaN ignored, +-Inf counting as FLT_MAX."""
    ae = tl.where(xe != xe, 0.0, tl.minimum(tl.abs(xe), 3.4028234663852886e38))
    ao = tl.where(xo != xo, 0.0, tl.minimum(tl.abs(xo), 3.4028234663852886e38))
    return tl.maximum(tl.max(ae, axis=1), tl.max(ao, axis=1))


@triton.jit
def _group_has_nan(xe, xo):
    return tl.max(((xe != xe) | (xo != xo)).to(tl.int32), axis=1) > 0


@triton.jit
def _clamp_finite(x):
    """+-Inf -> +-FLT_MAX; NaN kept (explicitly: a GPU min/max would drop it)."""
    return tl.where(x != x, x, tl.minimum(tl.maximum(x, -3.4028234663852886e38), 3.4028234663852886e38))


@triton.jit
def store_record(pool, slot, xe, xo, D: tl.constexpr, HG: tl.constexpr, FMT: tl.constexpr, R: tl.constexpr,
                 REC: tl.constexpr, DATA: tl.constexpr, SCALES: tl.constexpr, NOPE: tl.constexpr,
                 NSCALES: tl.constexpr):
    """Encode one D-vector and write it to ``slot`` (int64 scalar, >= 0).

    xe, xo: [D / (2·HG), HG] fp32, the even and odd channels: pair p = g·HG + i holds channels
    2p and 2p + 1, so row g is quantization group g (group size 2·HG) and a packed fp4 byte is
    (code(xe) | code(xo) << 4). For fp8_ds_mla the rows at and past NOPE / (2·HG) are the bf16 rope
    tail. Raw pools take the values cast to the pool dtype.
    """
    NG: tl.constexpr = D // (2 * HG)
    g = tl.arange(0, NG)[:, None]
    pair = g * HG + tl.arange(0, HG)[None, :]                     # [NG, HG]
    slot = slot.to(tl.int64)
    if FMT == 0:
        tl.store(pool + slot * D + 2 * pair, cast(xe, pool.dtype.element_ty))
        tl.store(pool + slot * D + 2 * pair + 1, cast(xo, pool.dtype.element_ty))
    else:
        data, scale = record_offsets(slot, R, REC, DATA, SCALES, FMT == 1)
        amax = _group_amax(xe, xo)                                # [NG]
        ce = _clamp_finite(xe)
        co = _clamp_finite(xo)
        if FMT == 1:
            exponent = ue8m0_exponent(amax, 448.0)
            inv = _pow2(-exponent)[:, None]                       # x / 2^e == x * 2^-e (power of two)
            is_nope = g < NOPE // (2 * HG)
            tl.store(pool + data + 2 * pair, e4m3_encode(ce * inv).to(tl.uint8), mask=is_nope)
            tl.store(pool + data + 2 * pair + 1, e4m3_encode(co * inv).to(tl.uint8), mask=is_nope)
            j = 2 * pair - NOPE                                   # rope element of the even channel
            be = bf16_encode(xe)
            bo = bf16_encode(xo)
            rope = ~is_nope
            tl.store(pool + data + NOPE + 2 * j, (be & 255).to(tl.uint8), mask=rope)
            tl.store(pool + data + NOPE + 2 * j + 1, (be >> 8).to(tl.uint8), mask=rope)
            tl.store(pool + data + NOPE + 2 * j + 2, (bo & 255).to(tl.uint8), mask=rope)
            tl.store(pool + data + NOPE + 2 * j + 3, (bo >> 8).to(tl.uint8), mask=rope)
            scale_codes = exponent + 127
        else:
            has_nan = _group_has_nan(xe, xo)
            if FMT == 2:
                scale_codes = e4m3_encode(tl.maximum(amax / 6.0, 0.001953125))
                scale_value = e4m3_decode(scale_codes)
                scale_codes = tl.where(has_nan, 0x7F, scale_codes)
            else:
                exponent = ue8m0_exponent(amax, 6.0)
                scale_value = _pow2(exponent)
                scale_codes = tl.where(has_nan, 255, exponent + 127)
            ye = tl.where(ce != ce, 0.0, ce) / scale_value[:, None]
            yo = tl.where(co != co, 0.0, co) / scale_value[:, None]
            packed = e2m1_encode(ye) | (e2m1_encode(yo) << 4)
            tl.store(pool + data + pair, packed.to(tl.uint8))
        gi = tl.arange(0, NG)
        tl.store(pool + scale + gi, scale_codes.to(tl.uint8), mask=gi < NSCALES)
        pad = NSCALES + tl.arange(0, 4)                           # zero padding up to SCALES bytes
        tl.store(pool + scale + pad, tl.zeros([4], tl.uint8), mask=pad < SCALES)


# ---- test kernels over the helpers ---------------------------------------------------------------

@triton.jit
def _scatter_kernel(x_ptr, slots_ptr, pool, D: tl.constexpr, HG: tl.constexpr, FMT: tl.constexpr,
                    R: tl.constexpr, REC: tl.constexpr, DATA: tl.constexpr, SCALES: tl.constexpr,
                    NOPE: tl.constexpr, GROUP: tl.constexpr, NSCALES: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        pair = tl.arange(0, D // (2 * HG))[:, None] * HG + tl.arange(0, HG)[None, :]
        base = x_ptr + row.to(tl.int64) * D
        xe = tl.load(base + 2 * pair).to(tl.float32)
        xo = tl.load(base + 2 * pair + 1).to(tl.float32)
        store_record(pool, slot, xe, xo, D, HG, FMT, R, REC, DATA, SCALES, NOPE, NSCALES)


@triton.jit
def _gather_kernel(pool, slots_ptr, out_ptr, M, D: tl.constexpr, BLOCK: tl.constexpr, FMT: tl.constexpr,
                   R: tl.constexpr, REC: tl.constexpr, DATA: tl.constexpr, SCALES: tl.constexpr,
                   NOPE: tl.constexpr, GROUP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slots = tl.load(slots_ptr + rows, mask=rows < M, other=-1)
    values = load_keys(pool, slots, slots >= 0, D, FMT, R, REC, DATA, SCALES, NOPE, GROUP)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :], values,
             mask=(rows < M)[:, None])


def quantize_scatter(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, fmt: str) -> None:
    """x [N, D] -> records at slots [N] (-1 skips) of ``pool``, in place (kernels.quantize_scatter)."""
    check_dim(x.shape[1])
    a = pool_args(pool, fmt, x.shape[1])
    kw = pool_constexprs(a)
    _scatter_kernel[(x.shape[0],)](x.contiguous(), slots.contiguous(), pool, D=x.shape[1],
                                   HG=pair_group(a, x.shape[1]), NSCALES=a.num_scales, **kw)


def gather_dequantize(pool: torch.Tensor, slots: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """slots [M] -> fp32 [M, dim]; slot -1 reads as a zero row (kernels.gather_dequantize)."""
    check_dim(dim)
    a = pool_args(pool, fmt, dim)
    out = torch.empty(slots.shape[0], dim, dtype=torch.float32, device=pool.device)
    block = 16
    _gather_kernel[(triton.cdiv(max(slots.shape[0], 1), block),)](
        pool, slots.contiguous(), out, slots.shape[0], D=dim, BLOCK=block, **pool_constexprs(a))
    return out
