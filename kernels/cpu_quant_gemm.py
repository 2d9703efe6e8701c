"""CPU GEMMs on FP8 / packed-FP4 weights without materialising the dequantized weight.

The weight is walked in N-tiles of about ``TILE_BYTES`` of fp32: numba decodes one tile's codes
and scales into a reused buffer (a 256- or 16-entry table lookup times the block scale: exactly
the reference's fp32 values, NaN and subnormals included), then one torch ``mm`` multiplies it
into the matching rows of a transposed fp32 output. Peak extra memory is one tile plus the fp32
activation, and the tile stays in cache between its decode and its use. Accumulation is fp32
(torch's sgemm), so results match kernels/reference.py up to summation order.

Activation fake-quantization (``act_quant_fp8``) is a numba row kernel on the branch-free codecs
of kernels/cpu_numerics.py: bit-exact to the reference.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from kernels import checks
from kernels.cpu_numerics import (F32, U32, amax_key, bits_f32, borrow, clamp_inf, e4m3_code, f32_bits,
                                  pow2, ue8m0_exponent, ue8m0_value)
from kernels.reference import ACT_GROUP, E2M1_VALUES, FP4_GROUP

TILE_BYTES = 1 << 21     # fp32 weight tile per mm: about a core's L2 (larger tiles help large M)
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


@njit(cache=True, error_model="numpy")
def _decode_fp8(src, table, s, dst):
    for j in range(src.shape[0]):
        dst[j] = table[src[j]] * s


@njit(cache=True, error_model="numpy")
def _decode_fp4(src, table, s, dst):
    for j in range(src.shape[0]):
        b = src[j]
        dst[2 * j] = table[b & 15] * s
        dst[2 * j + 1] = table[b >> 4] * s


@njit(parallel=True, cache=True, error_model="numpy")
def _dequant_fp8_rows(codes_arg, scale_arg, table_arg, block_n, block_k, row0, out_arg):
    """out[r] = e4m3(codes[r]) * scale[(row0 + r) // block_n, k // block_k]; codes [R, K] u8."""
    codes, scale, table, out = borrow(codes_arg), borrow(scale_arg), borrow(table_arg), borrow(out_arg)
    k = codes.shape[1]
    for r in prange(codes.shape[0]):
        src, dst, srow = codes[r], out[r], scale[(row0 + r) // block_n]
        for kb in range(srow.shape[0]):
            k0 = kb * block_k
            k1 = min(k0 + block_k, k)
            _decode_fp8(src[k0:k1], table, scale_value(srow[kb]), dst[k0:k1])


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


def _tiled_mm(a: torch.Tensor, n: int, row_align: int, dequant: Callable[[int, int, np.ndarray], None]) -> torch.Tensor:
    """a fp32 [M, K] @ W^T for W [N, K] produced tile by tile by dequant(n0, n1, buf) -> fp32 [N, M]."""
    m, k = a.shape
    out_t = torch.empty(n, m)                               # [N, M]: a tile's rows are contiguous
    rows = max(row_align, TILE_BYTES // (4 * max(k, 1)) // row_align * row_align)
    buf = torch.empty(min(rows, n), k)                      # [rows, K]
    for n0 in range(0, n, rows):
        n1 = min(n0 + rows, n)
        tile = buf[:n1 - n0]
        dequant(n0, n1, tile.numpy())
        torch.mm(tile, a.T, out=out_t[n0:n1])
    return out_t


def _fp8_mm(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    codes, s = _np(weight), _np(scale)
    bn, bk = block

    def dequant(n0: int, n1: int, buf: np.ndarray) -> None:
        _dequant_fp8_rows(codes[n0:n1], s, E4M3_TABLE, bn, bk, n0, buf)
    return _tiled_mm(a, weight.shape[0], bn, dequant)


def _fp4_mm(a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    pairs, s = _np(packed), _np(scale)

    def dequant(n0: int, n1: int, buf: np.ndarray) -> None:
        _dequant_fp4_rows(pairs[n0:n1], s[n0:n1], E2M1_TABLE, group, buf)
    return _tiled_mm(a, packed.shape[0], 1, dequant)


def _finish(out_t: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[N, M] fp32 -> [M, N] out_dtype, transposed and cast in one copy."""
    out = torch.empty(out_t.shape[1], out_t.shape[0], dtype=out_dtype)
    return out.copy_(out_t.T)


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


def _grouped(a: torch.Tensor, n: int, offsets: torch.Tensor, out_dtype: torch.dtype,
             expert_mm: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """Expert e's rows [offsets[e-1], offsets[e]) through expert_mm(rows, e) -> [N, rows];
    experts without rows are never decoded; rows past offsets[-1] stay zero."""
    out = torch.zeros(a.shape[0], n, dtype=out_dtype)       # [S, N]
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = expert_mm(a[start:end], e).T
        start = end
    return out


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   block: tuple[int, int] = (128, 128), act_quant: bool = False,
                   out_dtype: torch.dtype | None = None, act_group: int = ACT_GROUP) -> torch.Tensor:
    checks.check_fp8_gemm("fp8_grouped_mm", x, weight, scale, block, offsets, out_dtype, act_group)
    a = _activation(x, act_quant, act_group)
    return _grouped(a, weight.shape[1], offsets, out_dtype or x.dtype,
                    lambda rows, e: _fp8_mm(rows, weight[e], scale[e], tuple(block)))


def fp4_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   act_quant: bool = False, out_dtype: torch.dtype | None = None, group: int = FP4_GROUP,
                   act_group: int = ACT_GROUP) -> torch.Tensor:
    checks.check_fp4_gemm("fp4_grouped_mm", x, packed, scale, group, offsets, out_dtype, act_group)
    a = _activation(x, act_quant, act_group)
    return _grouped(a, packed.shape[1], offsets, out_dtype or x.dtype,
                    lambda rows, e: _fp4_mm(rows, packed[e], scale[e], group))
