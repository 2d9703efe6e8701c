"""Paged KV pool layouts as the fused decode kernels see them: which format code a pool holds,
its record geometry, and the checks every kernel (Triton, numba, torch reference) runs on it.

Pure Python and torch, no Triton: the CPU decode kernels and the torch references import it on
machines without Triton; kernels/triton/kv_codec.py re-exports it next to the device codecs.
Format codes: RAW (the pool holds bf16/fp16/fp32 values), FP8_DS_MLA, FP4_KV, FP4_INDEX. Pools
are ``[num_blocks, R, record_bytes]`` uint8 (raw: ``[.., R, D]``); slot = block * R + offset.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.formats import ROPE_DIM, get_format

RAW, FP8_DS_MLA, FP4_KV, FP4_INDEX = 0, 1, 2, 3
_CODES = {"fp8_ds_mla": FP8_DS_MLA, "fp4_kv": FP4_KV, "fp4_index": FP4_INDEX}
RAW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class PoolArgs:
    """The constexpr description of one pool a kernel reads or writes."""

    fmt: int           # RAW / FP8_DS_MLA / FP4_KV / FP4_INDEX
    records_per_block: int
    record_bytes: int  # raw: values per record (= D)
    data_bytes: int
    group: int         # values per scale (raw: 0)
    nope: int          # leading block-quantized values (fp8_ds_mla: D - 64; fp4: D; raw: 0)
    num_scales: int
    scale_bytes: int


def pool_args(pool: torch.Tensor, fmt: str, dim: int) -> PoolArgs:
    """Validate ``pool`` for records of ``dim`` values in ``fmt`` and describe it."""
    if pool.dim() != 3 or not pool.is_contiguous():
        raise ValueError(f"pool must be a contiguous [num_blocks, R, record] tensor, got {tuple(pool.shape)}")
    if fmt in RAW_DTYPES:
        if pool.dtype != RAW_DTYPES[fmt] or pool.shape[2] != dim:
            raise ValueError(f"{fmt} pool must be {RAW_DTYPES[fmt]} [.., R, {dim}], got {pool.dtype} "
                             f"{tuple(pool.shape)}")
        return PoolArgs(RAW, pool.shape[1], dim, 0, 0, 0, 0, 0)
    if fmt not in _CODES:
        raise ValueError(f"unsupported pool format {fmt!r}")
    f = get_format(fmt, dim)
    if pool.dtype != torch.uint8 or pool.shape[2] != f.record_bytes:
        raise ValueError(f"{fmt} pool must be uint8 [.., R, {f.record_bytes}], got {pool.dtype} {tuple(pool.shape)}")
    if fmt == "fp8_ds_mla" and f.dim - f.quant_dim != ROPE_DIM:
        raise ValueError("fp8_ds_mla keeps exactly 64 bf16 rope values")
    return PoolArgs(_CODES[fmt], pool.shape[1], f.record_bytes, f.data_bytes, f.group, f.quant_dim,
                    f.num_scales, f.scale_bytes)


def pair_group(a: PoolArgs, dim: int) -> int:
    """HG for ``store_record``: half a quantization group (raw: any divisor; 32 pairs or fewer)."""
    if a.fmt == RAW:
        return min(32, dim // 2)
    return a.group // 2


def pool_constexprs(a: PoolArgs, prefix: str = "") -> dict:
    """Keyword constexprs for ``load_keys`` / ``store_record`` (``prefix`` names several pools)."""
    return {f"{prefix}FMT": a.fmt, f"{prefix}R": a.records_per_block, f"{prefix}REC": a.record_bytes,
            f"{prefix}DATA": a.data_bytes, f"{prefix}SCALES": a.scale_bytes, f"{prefix}NOPE": a.nope,
            f"{prefix}GROUP": max(a.group, 1)}


def check_dim(dim: int) -> None:
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"Triton KV kernels need a power-of-two dim >= 16, got {dim}")
