"""Numba codecs (bf16, e4m3fn, e2m1, ue8m0) following the rules in kernels/formats.py.

Every helper works on fp32 bit patterns held in uint32 and is branch-free (masks, min/max;
a Python ternary stays a branch in LLVM and stops vectorisation), so the loops of
kernels/cpu_kv.py that call them vectorise. LLVM inlines these small jitted functions into the
loops; numba-level ``inline="always"`` is avoided because it multiplies compile time.
Results are bit-exact against the torch reference: only exact fp32 operations (multiplication
by powers of two, exact products) plus the IEEE-rounded divisions the rules prescribe; no
``fastmath``. The encoders were checked against the previous scalar versions on all 2^32
fp32 bit patterns.

Numba widens uint32 arithmetic to 64 bits, so every intermediate is wrapped in ``U32``; the
constants are typed globals (numba freezes them into the code).

Caching: numba's own on-disk cache checks only the file that defines a kernel, while the kernels
of cpu_kv.py (and most others) carry this module's code inlined; kernels/cpu_cache.py, installed
here before any kernel is decorated, stamps every kernel with all the kernel sources instead.
"""
from __future__ import annotations

from kernels import cpu_cache  # noqa: F401  (first: the cache locators, before any @njit below)

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

U8, U16, U32, U64, I32, F32 = np.uint8, np.uint16, np.uint32, np.uint64, np.int32, np.float32
I8, I16 = np.int8, np.int16


def _bits(v: float) -> np.uint32:
    return np.array(v, dtype=np.float32).view(np.uint32)[()]


ABS_MASK = U32(0x7FFFFFFF)
INF_BITS = U32(0x7F800000)
FLT_MAX_BITS = U32(0x7F7FFFFF)
BF16_NAN_BITS = U16(0x7FC0)
E4M3_NAN_CODE = U8(0x7F)
UE8M0_NAN_CODE = U8(0xFF)
E4M3_MAX_BITS = _bits(448.0)
E4M3_MIN_NORMAL_BITS = _bits(2.0 ** -6)
# y + 2^14 rounds y to a multiple of 2^-9 (the e4m3 subnormal step), ties to even.
E4M3_SUB_MAGIC = F32(2.0 ** 14)
E4M3_SUB_MAGIC_BITS = _bits(2.0 ** 14)
E4M3_FROM_F32_BIAS = F32(2.0 ** 120)   # e4m3 bits placed in an fp32 read 2^120 too small
E2M1_FROM_F32_BIAS = F32(2.0 ** 126)   # likewise for e2m1 bits
E2M1_MAX_BITS = _bits(6.0)
E2M1_MIN_NORMAL_BITS = _bits(1.0)
E2M1_SUB_MAGIC = F32(2.0 ** 22)         # its ulp is 0.5, the e2m1 subnormal step
E2M1_SUB_MAGIC_BITS = _bits(2.0 ** 22)


# ---- bit casts and input / output element access ------------------------------------------

@njit(cache=True, error_model="numpy")
def f32_bits(v):
    return F32(v).view(U32)


@njit(cache=True, error_model="numpy")
def bits_f32(u):
    return U32(u).view(F32)


def load_bits(v):
    """fp32 bits of an input element: a uint32 (fp32 viewed as bits) or uint16 (bf16 bits)."""


@overload(load_bits)
def _load_bits_impl(v):
    if isinstance(v, types.Integer) and v.bitwidth == 16:
        return lambda v: U32(U32(v) << U32(16))
    if isinstance(v, types.Integer):
        return lambda v: U32(v)
    return lambda v: f32_bits(v)


def store_value(out, j, v):
    """out[j] = v (fp32), where out is float32 or uint16 (bf16 bits, RNE, NaN -> 0x7FC0)."""


@overload(store_value)
def _store_value_impl(out, j, v):
    if isinstance(out.dtype, types.Integer):
        def impl(out, j, v):
            out[j] = bf16_bits(f32_bits(v))
        return impl

    def impl(out, j, v):
        out[j] = v
    return impl


def round_as(arr, v):
    """fp32 v rounded to arr's element type, as fp32: an integer array holds bf16 bits (RNE, NaN
    -> 0x7FC0), a float32 array keeps v."""


@overload(round_as)
def _round_as_impl(arr, v):
    if isinstance(arr.dtype, types.Integer):
        return lambda arr, v: bits_f32(U32(U32(bf16_bits(f32_bits(v))) << U32(16)))
    return lambda arr, v: F32(v)


def load_pair(p):
    """fp32 bits (lo, hi) of two adjacent input elements read as one word: uint32 holds two
    bf16 values, uint64 two fp32 values (little-endian: the even element is the low half)."""


@overload(load_pair)
def _load_pair_impl(p):
    if p.bitwidth == 32:
        return lambda p: (U32(p << U32(16)), U32(p & U32(0xFFFF0000)))
    return lambda p: (U32(p & np.uint64(0xFFFFFFFF)), U32(p >> np.uint64(32)))


def store_pair(out, k, lo, hi):
    """Store fp32 values lo, hi as output elements 2k, 2k+1 of a row viewed as words: uint32
    (two bf16, RNE) or uint64 (two fp32)."""


@overload(store_pair)
def _store_pair_impl(out, k, lo, hi):
    if out.dtype.bitwidth == 32:
        def impl(out, k, lo, hi):
            out[k] = U32(U32(bf16_bits(f32_bits(lo))) | U32(U32(bf16_bits(f32_bits(hi))) << U32(16)))
        return impl

    def impl(out, k, lo, hi):
        out[k] = np.uint64(f32_bits(lo)) | (np.uint64(f32_bits(hi)) << np.uint64(32))
    return impl


@intrinsic
def borrow(typingctx, arr):
    """The same array view without its owner (NULL meminfo): slicing it and passing it to other
    jitted functions then costs no atomic reference counting, which two threads working on the
    same pool would otherwise contend on. Only for arrays the caller keeps alive for the whole
    call (kernel arguments), never for arrays allocated inside the kernel."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, value=args[0])
        dst = context.make_array(sig.return_type)(context, builder)
        for field in ("nitems", "itemsize", "data", "shape", "strides"):
            setattr(dst, field, getattr(src, field))
        dst.meminfo = cgutils.get_null_value(dst.meminfo.type)
        dst.parent = cgutils.get_null_value(dst.parent.type)
        return dst._getvalue()
    return arr(arr), codegen


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the cache line of arr[index] into the caches (llvm.prefetch, read, high locality).
    The address is only computed, never dereferenced: any index is safe."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        ptr = builder.gep(ary.data, [args[1]])
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32),
                                                            ir.IntType(32)]), "llvm.prefetch.p0")
        i32 = ir.IntType(32)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.none(arr, index), codegen


@intrinsic
def half_value(typingctx, bits):
    """The fp32 value of IEEE half-precision bits (a uint16): LLVM's fpext from half, which x86
    with F16C (every AVX2 CPU) vectorises as vcvtph2ps, subnormal halves included at full speed,
    and other targets lower natively or by a library call. Exact: every half is an fp32."""
    if not isinstance(bits, types.Integer) or bits.bitwidth != 16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(bits), codegen


# ---- scalar rules, branch-free (masks instead of selects: LLVM keeps ternaries as branches) ---

ALL_ONES = U32(0xFFFFFFFF)
UE8M0_FLOOR_BITS = _bits(1e-4)


@njit(cache=True, error_model="numpy")
def mask(b):
    """All ones when b is true, else 0."""
    return U32(U32(0) - U32(b))


@njit(cache=True, error_model="numpy")
def select(m, a, b):
    """a where the mask m is set, else b (uint32 bit patterns)."""
    return U32(U32(a & m) | U32(b & U32(m ^ ALL_ONES)))


@njit(cache=True, error_model="numpy")
def bf16_bits(u):
    """fp32 bits -> bf16 bits, RNE; NaN -> 0x7FC0."""
    r = U32(U32(u + U32(0x7FFF) + ((u >> U32(16)) & U32(1))) >> U32(16))
    return U16(select(mask(U32(u & ABS_MASK) > INF_BITS), U32(BF16_NAN_BITS), r))


@njit(cache=True, error_model="numpy")
def amax_key(u):
    """|x| bits for a block amax: NaN counts as 0, +-Inf as FLT_MAX (bits order like values)."""
    a = U32(u & ABS_MASK)
    return U32(U32(min(a, FLT_MAX_BITS)) & mask(a <= INF_BITS))


@njit(cache=True, error_model="numpy")
def clamp_inf(u):
    """+-Inf -> +-FLT_MAX (the bits just below); NaN and finite values unchanged."""
    return U32(u - U32(U32(u & ABS_MASK) == INF_BITS))


@njit(cache=True, error_model="numpy")
def fp4_input(u):
    """An fp4 element: +-Inf -> +-FLT_MAX, NaN -> +0."""
    a = U32(u & ABS_MASK)
    return U32(U32(u - U32(a == INF_BITS)) & mask(a <= INF_BITS))


@njit(cache=True, error_model="numpy")
def e4m3_code(u):
    """fp32 bits -> e4m3fn code: RNE, saturating at 448, sign kept; NaN -> 0x7F."""
    a0 = U32(u & ABS_MASK)
    a = U32(min(a0, E4M3_MAX_BITS))
    normal = U32(U32(U32(a + U32(0x7FFFF) + ((a >> U32(20)) & U32(1))) >> U32(20)) - U32(120 << 3))
    sub = U32(f32_bits(F32(bits_f32(a) + E4M3_SUB_MAGIC)) - E4M3_SUB_MAGIC_BITS)
    code = U32(select(mask(a < E4M3_MIN_NORMAL_BITS), sub, normal) | ((u >> U32(24)) & U32(0x80)))
    return U8(select(mask(a0 > INF_BITS), U32(E4M3_NAN_CODE), code))


@njit(cache=True, error_model="numpy")
def e4m3_value(c):
    """e4m3fn code -> fp32 (exact); 0x7F / 0xFF -> NaN."""
    c32 = U32(c)
    v = F32(bits_f32(U32(((c32 & U32(0x80)) << U32(24)) | ((c32 & U32(0x7F)) << U32(20))))
            * E4M3_FROM_F32_BIAS)
    return bits_f32(U32(f32_bits(v) | U32(mask(U32(c32 & U32(0x7F)) == U32(0x7F)) & U32(0x7FC00000))))


@njit(cache=True, error_model="numpy")
def e2m1_code(u):
    """fp32 bits (not NaN) -> e2m1 code: RNE (ties to the even code), saturating at 6, sign kept.

    |y| >= 1 rounds its mantissa to one bit with the usual integer RNE on the bits; |y| < 1
    rounds to a multiple of 0.5 by adding 2^22 (whose ulp is 0.5), ties to even.
    """
    a = U32(min(U32(u & ABS_MASK), E2M1_MAX_BITS))
    normal = U32(U32(U32(a + U32(0x1FFFFF) + ((a >> U32(22)) & U32(1))) >> U32(22)) - U32(126 << 1))
    sub = U32(f32_bits(F32(bits_f32(a) + E2M1_SUB_MAGIC)) - E2M1_SUB_MAGIC_BITS)
    return U32(select(mask(a < E2M1_MIN_NORMAL_BITS), sub, normal) | ((u >> U32(28)) & U32(8)))


@njit(cache=True, error_model="numpy")
def e2m1_value(c):
    """e2m1 code (low 4 bits of c) -> fp32, exact; code 8 is -0."""
    c32 = U32(c)
    return F32(bits_f32(U32(((c32 & U32(8)) << U32(28)) | ((c32 & U32(7)) << U32(22))))
               * E2M1_FROM_F32_BIAS)


@njit(cache=True, error_model="numpy")
def ue8m0_exponent(amax_bits, qmax):
    """ceil(log2(max(amax, 1e-4) / qmax)) for amax given as (non-negative) fp32 bits, exact:
    read off the bits of the fp32 quotient, which is normal."""
    u = f32_bits(F32(bits_f32(U32(max(amax_bits, UE8M0_FLOOR_BITS))) / qmax))
    return I32(I32(u >> U32(23)) - I32(127) + I32(U32(u & U32(0x7FFFFF)) != U32(0)))


@njit(cache=True, error_model="numpy")
def pow2(exponent):
    """2^exponent as fp32 for exponent in [-126, 127]."""
    return bits_f32(U32(U32(exponent + I32(127)) << U32(23)))


@njit(cache=True, error_model="numpy")
def ue8m0_value(code):
    """2^(code - 127) as fp32 (code 0: the subnormal 2^-127); code 0xFF -> NaN."""
    c32 = U32(code)
    special = U32(U32(U32(c32 == U32(0)) | U32(c32 == U32(0xFF))) << U32(22))
    return bits_f32(U32(U32(c32 << U32(23)) | special))


@njit(cache=True, error_model="numpy")
def e4m3_half_bits(code):
    """IEEE half bits worth e4m3fn(code) / 256. The half's exponent bias (15) is e4m3's (7) plus 8,
    so e4m3's exponent and mantissa fields moved into the half's give that value for every code,
    subnormals included (they land on half subnormals). The byte sign-extended to 16 bits and
    shifted left by 7 puts the sign in bit 15 (its copy in bit 14 is cleared) and the fields in
    bits 13..7. Only the NaN codes 0x7F / 0xFF have bits 13..7 all ones, so adding 1 << 7
    carries into bit 14 for them alone, and OR-ing that carry in makes the half's exponent all
    ones with a nonzero mantissa: a NaN. Five 16-bit vector ops per 8 codes (the previous mask
    and select decode took eight, and ran 1.4x slower per weight), then `half_value`
    (vcvtph2ps); every code is checked against torch's decode in tests/kernels/test_quant_gemm.py."""
    h = U16(U16(I16(I8(code)) << I16(7)) & U16(0xBFFF))
    return U16(h | (U16(h + U16(0x80)) & U16(0x4000)))
