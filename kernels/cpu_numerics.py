"""Numba scalar codecs (bf16, e4m3fn, e2m1, ue8m0) following the rules in kernels/formats.py.

Every helper works on fp32 values and integer bit patterns only, so results are bit-exact
and match the torch reference. ``as_f32`` / ``store_value`` read bf16 stored as uint16 bits.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

F32 = np.float32
BF16_NAN_BITS = np.uint16(0x7FC0)
E4M3_NAN_CODE = np.uint8(0x7F)
UE8M0_NAN_CODE = np.uint8(0xFF)
FLT_MAX = F32(np.finfo(np.float32).max)
E4M3_MIN_NORMAL = F32(2.0 ** -6)


def _e4m3_table() -> np.ndarray:
    """The fp32 value of each of the 256 e4m3fn codes (0x7F, 0xFF: NaN)."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 15, (codes & 7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6,
                         (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = np.where(codes >= 128, -magnitude, magnitude)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_table()
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


@njit(cache=True, inline="always")
def f32_bits(v):
    return F32(v).view(np.uint32)


@njit(cache=True, inline="always")
def bits_f32(u):
    return np.uint32(u).view(np.float32)


@njit(cache=True, inline="always")
def bf16_encode(v):
    """fp32 -> bf16 bits, RNE; NaN -> 0x7FC0."""
    if v != v:
        return BF16_NAN_BITS
    u = f32_bits(v)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def as_f32(v):
    """An element of a float32 array, or of a uint16 array holding bf16 bits, as fp32."""


@overload(as_f32)
def _as_f32_impl(v):
    if isinstance(v, types.Integer):
        return lambda v: bits_f32(np.uint32(v) << np.uint32(16))
    return lambda v: F32(v)


def store_value(out, i, j, v):
    """out[i, j] = v, where out is float32 or uint16 (bf16 bits, RNE)."""


@overload(store_value)
def _store_value_impl(out, i, j, v):
    if isinstance(out.dtype, types.Integer):
        def impl(out, i, j, v):
            out[i, j] = bf16_encode(v)
        return impl

    def impl(out, i, j, v):
        out[i, j] = v
    return impl


@njit(cache=True, inline="always")
def clamp_finite(v):
    """+-Inf -> +-FLT_MAX; NaN and finite values unchanged."""
    if v > FLT_MAX:
        return FLT_MAX
    if v < -FLT_MAX:
        return -FLT_MAX
    return v


@njit(cache=True, inline="always")
def nan_free_abs(v):
    """|v| for the amax; NaN counts as 0."""
    if v != v:
        return F32(0.0)
    return abs(v)


@njit(cache=True, inline="always")
def e4m3_encode(y):
    """fp32 -> e4m3fn code: RNE, saturating at 448, sign kept; NaN -> 0x7F."""
    if y != y:
        return E4M3_NAN_CODE
    sign = np.uint8(0x80) if f32_bits(y) >> np.uint32(31) else np.uint8(0)
    a = min(abs(y), F32(448.0))
    if a < E4M3_MIN_NORMAL:
        # Subnormal step 2^-9; rint rounds half to even and 8 lands exactly on code 0x08.
        return sign | np.uint8(np.rint(a * F32(512.0)))
    u = f32_bits(a)
    u = u + np.uint32(0x7FFFF) + ((u >> np.uint32(20)) & np.uint32(1))
    exponent = (u >> np.uint32(23)) - np.uint32(120)
    return sign | np.uint8((exponent << np.uint32(3)) | ((u >> np.uint32(20)) & np.uint32(7)))


@njit(cache=True, inline="always")
def e2m1_encode(y):
    """fp32 -> e2m1 code: RNE (ties to the even code), saturating at 6, sign kept."""
    a = abs(y)
    m = ((a > F32(0.25)) + (a >= F32(0.75)) + (a > F32(1.25)) + (a >= F32(1.75))
         + (a > F32(2.5)) + (a >= F32(3.5)) + (a > F32(5.0)))
    if f32_bits(y) >> np.uint32(31):
        m += 8
    return np.uint8(m)


@njit(cache=True, inline="always")
def ue8m0_exponent(amax, qmax):
    """ceil(log2(max(amax, 1e-4) / qmax)) for an fp32 amax, exact (the quotient is normal)."""
    u = f32_bits(max(amax, F32(1e-4)) / qmax)
    exponent = np.int32(u >> np.uint32(23)) - np.int32(127)
    if u & np.uint32(0x7FFFFF):
        exponent += 1
    return exponent


@njit(cache=True, inline="always")
def pow2(exponent):
    """2^exponent as fp32 for exponent in [-126, 127]."""
    return bits_f32(np.uint32(exponent + 127) << np.uint32(23))


@njit(cache=True, inline="always")
def ue8m0_value(code):
    """2^(code - 127) as fp32 (subnormal for code 0); code 0xFF -> NaN."""
    if code == UE8M0_NAN_CODE:
        return F32(np.nan)
    if code == 0:
        return F32(2.0 ** -127)
    return bits_f32(np.uint32(code) << np.uint32(23))
