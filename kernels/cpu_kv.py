"""CPU (numba) quantize-scatter / gather-dequantize for the formats in kernels/formats.py.

Plain ``quantize``/``dequantize`` are the paged ops on a pool of one-token blocks with slots
0..N-1 (a one-token block of fp8_ds_mla is exactly its standalone record). Rows with slot -1
are skipped on scatter and read as zeros on gather. Inputs arrive as float32 or as uint16 bf16
bits; gather writes float32 or uint16 bf16 bits.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from kernels import checks
from kernels.cpu_numerics import (E2M1_VALUES, E4M3_VALUES, F32, UE8M0_NAN_CODE, as_f32, bf16_encode,
                                  clamp_finite, e2m1_encode, e4m3_encode, nan_free_abs, pow2,
                                  store_value, ue8m0_exponent, ue8m0_value)
from kernels.formats import E4M3_MIN_SUBNORMAL, KVFormat

_E4M3_NAN = np.uint8(0x7F)
_MIN_SCALE = F32(E4M3_MIN_SUBNORMAL)


@njit(cache=True, inline="always")
def _offsets(slot, block_size, data_bytes, scale_bytes, split_block):
    block, pos = slot // block_size, slot % block_size
    base = block * block_size * (data_bytes + scale_bytes)
    if split_block:
        return base + pos * data_bytes, base + block_size * data_bytes + pos * scale_bytes
    data = base + pos * (data_bytes + scale_bytes)
    return data, data + data_bytes


# ---- scatter --------------------------------------------------------------------------------

@njit(parallel=True, cache=True)
def _scatter_bf16(x, slots, pool16):
    dim = x.shape[1]
    for i in prange(x.shape[0]):
        if slots[i] < 0:
            continue
        base = slots[i] * dim
        for j in range(dim):
            pool16[base + j] = bf16_encode(as_f32(x[i, j]))


@njit(parallel=True, cache=True)
def _scatter_fp8_ds_mla(x, slots, pool, block_size, nope, group, data_bytes, scale_bytes):
    dim = x.shape[1]
    for i in prange(x.shape[0]):
        if slots[i] < 0:
            continue
        data, scales = _offsets(slots[i], block_size, data_bytes, scale_bytes, True)
        for g in range(nope // group):
            amax = F32(0.0)
            for j in range(g * group, (g + 1) * group):
                amax = max(amax, nan_free_abs(clamp_finite(as_f32(x[i, j]))))
            exponent = ue8m0_exponent(amax, F32(448.0))
            inv_scale = pow2(-exponent)
            for j in range(g * group, (g + 1) * group):
                pool[data + j] = e4m3_encode(clamp_finite(as_f32(x[i, j])) * inv_scale)
            pool[scales + g] = np.uint8(exponent + 127)
        for g in range(nope // group, scale_bytes):
            pool[scales + g] = 0
        for j in range(nope, dim):
            bits = bf16_encode(as_f32(x[i, j]))
            pool[data + nope + 2 * (j - nope)] = np.uint8(bits & 0xFF)
            pool[data + nope + 2 * (j - nope) + 1] = np.uint8(bits >> 8)


@njit(parallel=True, cache=True)
def _scatter_fp4(x, slots, pool, block_size, group, ue8m0):
    """fp4_kv (ue8m0=False: e4m3 scales) and fp4_index (ue8m0=True)."""
    dim = x.shape[1]
    data_bytes, scale_bytes = dim // 2, dim // group
    for i in prange(x.shape[0]):
        if slots[i] < 0:
            continue
        data, scales = _offsets(slots[i], block_size, data_bytes, scale_bytes, False)
        for g in range(dim // group):
            amax = F32(0.0)
            has_nan = False
            for j in range(g * group, (g + 1) * group):
                v = as_f32(x[i, j])
                has_nan |= v != v
                amax = max(amax, nan_free_abs(clamp_finite(v)))
            if ue8m0:
                exponent = ue8m0_exponent(amax, F32(6.0))
                scale = pow2(exponent)
                code = UE8M0_NAN_CODE if has_nan else np.uint8(exponent + 127)
            else:
                code = e4m3_encode(max(amax / F32(6.0), _MIN_SCALE))
                scale = E4M3_VALUES[code]
                code = _E4M3_NAN if has_nan else code
            pool[scales + g] = code
            for j in range(g * group, (g + 1) * group, 2):
                lo = e2m1_encode(_fp4_input(x[i, j]) / scale)
                hi = e2m1_encode(_fp4_input(x[i, j + 1]) / scale)
                pool[data + j // 2] = lo | (hi << np.uint8(4))


@njit(cache=True, inline="always")
def _fp4_input(raw):
    v = clamp_finite(as_f32(raw))
    return F32(0.0) if v != v else v


# ---- gather ---------------------------------------------------------------------------------

@njit(parallel=True, cache=True)
def _gather_bf16(pool16, slots, out):
    dim = out.shape[1]
    for i in prange(slots.shape[0]):
        for j in range(dim):
            if slots[i] < 0:
                store_value(out, i, j, F32(0.0))
            else:
                store_value(out, i, j, as_f32(pool16[slots[i] * dim + j]))


@njit(parallel=True, cache=True)
def _gather_fp8_ds_mla(pool, slots, out, block_size, nope, group, data_bytes, scale_bytes):
    dim = out.shape[1]
    for i in prange(slots.shape[0]):
        if slots[i] < 0:
            for j in range(dim):
                store_value(out, i, j, F32(0.0))
            continue
        data, scales = _offsets(slots[i], block_size, data_bytes, scale_bytes, True)
        for g in range(nope // group):
            scale = ue8m0_value(pool[scales + g])
            for j in range(g * group, (g + 1) * group):
                store_value(out, i, j, E4M3_VALUES[pool[data + j]] * scale)
        for j in range(nope, dim):
            lo, hi = pool[data + nope + 2 * (j - nope)], pool[data + nope + 2 * (j - nope) + 1]
            store_value(out, i, j, as_f32(np.uint16(lo) | (np.uint16(hi) << np.uint16(8))))


@njit(parallel=True, cache=True)
def _gather_fp4(pool, slots, out, block_size, group, ue8m0):
    dim = out.shape[1]
    data_bytes, scale_bytes = dim // 2, dim // group
    for i in prange(slots.shape[0]):
        if slots[i] < 0:
            for j in range(dim):
                store_value(out, i, j, F32(0.0))
            continue
        data, scales = _offsets(slots[i], block_size, data_bytes, scale_bytes, False)
        for g in range(dim // group):
            code = pool[scales + g]
            scale = ue8m0_value(code) if ue8m0 else E4M3_VALUES[code]
            for j in range(g * group, (g + 1) * group, 2):
                byte = pool[data + j // 2]
                store_value(out, i, j, E2M1_VALUES[byte & 15] * scale)
                store_value(out, i, j + 1, E2M1_VALUES[byte >> 4] * scale)


# ---- torch-facing wrappers --------------------------------------------------------------------

def _input_array(x: torch.Tensor) -> np.ndarray:
    x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.float().numpy()


def scatter_records(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, f: KVFormat) -> None:
    """Write quantized rows of x into the contiguous uint8 pool [blocks, B, R] (in place)."""
    xs, flat, block_size = _input_array(x), pool.view(-1).numpy(), pool.shape[1]
    sl = slots.contiguous().numpy()
    if f.name == "bf16":
        _scatter_bf16(xs, sl, flat.view(np.uint16))
    elif f.name == "fp8_ds_mla":
        _scatter_fp8_ds_mla(xs, sl, flat, block_size, f.quant_dim, f.group, f.data_bytes, f.scale_bytes)
    else:
        _scatter_fp4(xs, sl, flat, block_size, f.group, f.name == "fp4_index")


def gather_records(pool: torch.Tensor, slots: torch.Tensor, f: KVFormat, out_dtype: torch.dtype) -> torch.Tensor:
    """Dequantize slots [M] of the pool -> [M, D] in out_dtype; slot -1 gives zeros."""
    bf16_out = out_dtype == torch.bfloat16
    out = torch.empty((slots.shape[0], f.dim), dtype=torch.int16 if bf16_out else torch.float32)
    res = out.numpy().view(np.uint16) if bf16_out else out.numpy()
    flat, block_size, sl = pool.view(-1).numpy(), pool.shape[1], slots.contiguous().numpy()
    if f.name == "bf16":
        _gather_bf16(flat.view(np.uint16), sl, res)
    elif f.name == "fp8_ds_mla":
        _gather_fp8_ds_mla(flat, sl, res, block_size, f.quant_dim, f.group, f.data_bytes, f.scale_bytes)
    else:
        _gather_fp4(flat, sl, res, block_size, f.group, f.name == "fp4_index")
    return out.view(torch.bfloat16) if bf16_out else out.to(out_dtype)


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    f = checks.check_values(x, fmt)
    records = torch.empty((x.shape[0], 1, f.record_bytes), dtype=torch.uint8)
    scatter_records(x, records, torch.arange(x.shape[0]), f)
    return records.view(x.shape[0], f.record_bytes)


def dequantize(records: torch.Tensor, fmt: str, out_dtype: torch.dtype = torch.float32,
               dim: int | None = None) -> torch.Tensor:
    f = checks.format_for_records(records, fmt, dim)
    checks.check_records(records, f)
    checks.check_out_dtype(out_dtype)
    pool = records.contiguous().view(records.shape[0], 1, f.record_bytes)
    return gather_records(pool, torch.arange(records.shape[0]), f, out_dtype)


def quantize_scatter(x: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor, fmt: str) -> None:
    f = checks.check_values(x, fmt)
    checks.check_pool(pool, f)
    checks.check_slots(slot_mapping, x.shape[0], pool.shape[0] * pool.shape[1], check_range=True)
    scatter_records(x, pool, slot_mapping, f)


def gather_dequantize(pool: torch.Tensor, slots: torch.Tensor, fmt: str,
                      out_dtype: torch.dtype = torch.float32, dim: int | None = None) -> torch.Tensor:
    f = checks.format_for_records(pool, fmt, dim)
    checks.check_pool(pool, f)
    checks.check_out_dtype(out_dtype)
    checks.check_slots(slots, None, pool.shape[0] * pool.shape[1], check_range=True)
    return gather_records(pool, slots, f, out_dtype)
