"""CuPy launches of kernels/cuda/kv_cache.cu on torch CUDA tensors (on their device, on torch's
current stream there: see kernels/devices.py).

Validation here never syncs with the device: slot ranges are not checked on the host; the
kernels skip (scatter) or zero (gather) slots outside the pool instead.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels import checks
from kernels.cuda_names import IN_TYPES, NAME_EXPRESSIONS
from kernels.devices import cupy_launch
from kernels.formats import KVFormat
from kernels.loader import load_module

THREADS = 128


def _kernel_name(prefix: str, dtype: torch.dtype, f: KVFormat) -> str:
    ctype = IN_TYPES[str(dtype).removeprefix("torch.")]
    args = {"bf16": "", "fp8_ds_mla": ", 64", "fp4_kv": ", 16, false", "fp4_index": ", 32, true"}[f.name]
    kind = "fp4" if f.name.startswith("fp4") else f.name
    return f"{prefix}_{kind}<{ctype}{args}>"


def _launch(name: str, device_tensor: torch.Tensor, rows: int, args: tuple) -> None:
    if rows == 0:
        return
    with cupy_launch(device_tensor):   # the module is loaded per device: look the kernel up inside
        kernel = load_module("kv_cache", name_expressions=NAME_EXPRESSIONS["kv_cache"]).get_function(name)
        kernel((rows,), (THREADS,), args)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _layout_args(f: KVFormat, block_size: int, capacity: int) -> tuple:
    cap = np.int64(capacity)
    if f.name == "bf16":
        return (np.int32(f.dim), cap)
    if f.name == "fp8_ds_mla":
        return (np.int32(f.dim), np.int32(f.quant_dim), np.int32(f.data_bytes),
                np.int32(f.scale_bytes), np.int32(block_size), cap)
    return (np.int32(f.dim), np.int32(block_size), cap)


def quantize_scatter(x: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor, fmt: str) -> None:
    f = checks.check_values(x, fmt)
    checks.check_pool(pool, f)
    checks.check_slots(slot_mapping, x.shape[0], pool.shape[0] * pool.shape[1], check_range=False)
    x, slots = x.contiguous(), slot_mapping.contiguous()
    args = (_ptr(x), _ptr(slots), _ptr(pool)) + _layout_args(f, pool.shape[1], pool.shape[0] * pool.shape[1])
    _launch(_kernel_name("scatter", x.dtype, f), pool, x.shape[0], args)


def gather_dequantize(pool: torch.Tensor, slots: torch.Tensor, fmt: str,
                      out_dtype: torch.dtype = torch.float32, dim: int | None = None) -> torch.Tensor:
    f = checks.format_for_records(pool, fmt, dim)
    checks.check_pool(pool, f)
    checks.check_slots(slots, None, pool.shape[0] * pool.shape[1], check_range=False)
    checks.check_out_dtype(out_dtype)
    slots = slots.contiguous()
    out = torch.empty((slots.shape[0], f.dim), dtype=out_dtype, device=pool.device)
    args = (_ptr(pool), _ptr(slots), _ptr(out)) + _layout_args(f, pool.shape[1], pool.shape[0] * pool.shape[1])
    _launch(_kernel_name("gather", out_dtype, f), pool, slots.shape[0], args)
    return out


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    f = checks.check_values(x, fmt)
    records = torch.empty((x.shape[0], 1, f.record_bytes), dtype=torch.uint8, device=x.device)
    quantize_scatter(x, records, torch.arange(x.shape[0], device=x.device), fmt)
    return records.view(x.shape[0], f.record_bytes)


def dequantize(records: torch.Tensor, fmt: str, out_dtype: torch.dtype = torch.float32,
               dim: int | None = None) -> torch.Tensor:
    f = checks.format_for_records(records, fmt, dim)
    checks.check_records(records, f)
    pool = records.contiguous().view(records.shape[0], 1, f.record_bytes)
    return gather_dequantize(pool, torch.arange(records.shape[0], device=records.device), fmt, out_dtype, f.dim)
