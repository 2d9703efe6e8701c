"""Argument validation shared by every implementation; raises ValueError with the reason."""
from __future__ import annotations

import torch

from kernels.formats import KVFormat, get_format

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_values(x: torch.Tensor, fmt: str) -> KVFormat:
    """x must be [N, D] float; returns the layout for D."""
    if x.dim() != 2:
        raise ValueError(f"expected x of shape [N, D], got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be one of {FLOAT_DTYPES}, got {x.dtype}")
    return get_format(fmt, x.shape[1])


def check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def check_records(records: torch.Tensor, fmt: KVFormat) -> None:
    if records.dtype != torch.uint8 or records.dim() != 2:
        raise ValueError(f"records must be uint8 [N, R], got {records.dtype} {tuple(records.shape)}")
    if records.shape[1] != fmt.record_bytes:
        raise ValueError(f"{fmt.name} records of dim {fmt.dim} are {fmt.record_bytes} bytes, "
                         f"got {records.shape[1]}")


def format_for_records(records_or_pool: torch.Tensor, fmt: str, dim: int | None) -> KVFormat:
    """Layout of a record/pool whose last dim is the record size; ``dim`` defaults per format."""
    nbytes = records_or_pool.shape[-1]
    if dim is None:
        dim = _dim_from_record_bytes(fmt, nbytes)
    return get_format(fmt, dim)


def _dim_from_record_bytes(fmt: str, nbytes: int) -> int:
    get_format(fmt, 512 if fmt != "fp4_index" else 128)   # rejects unknown names
    if fmt == "bf16":
        return nbytes // 2
    if fmt == "fp4_kv":
        return nbytes * 16 // 9        # D/2 + D/16 = 9D/16
    if fmt == "fp4_index":
        return nbytes * 32 // 17       # D/2 + D/32 = 17D/32
    for dim in range(128, 4 * nbytes, 64):   # fp8_ds_mla: scale padding is not invertible
        if get_format(fmt, dim).record_bytes == nbytes:
            return dim
    raise ValueError(f"fp8_ds_mla: no dim has {nbytes}-byte records")


def check_pool(pool: torch.Tensor, fmt: KVFormat) -> None:
    if pool.dtype != torch.uint8 or pool.dim() != 3:
        raise ValueError(f"pool must be uint8 [num_blocks, block_size, record_bytes], "
                         f"got {pool.dtype} {tuple(pool.shape)}")
    if pool.shape[2] != fmt.record_bytes:
        raise ValueError(f"{fmt.name} pool needs {fmt.record_bytes}-byte records, got {pool.shape[2]}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")


def check_slots(slots: torch.Tensor, num_rows: int | None, capacity: int, check_range: bool) -> None:
    """slots: int64 [num_rows]; -1 skips; others must lie in [0, capacity)."""
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise ValueError(f"slots must be int64 [N], got {slots.dtype} {tuple(slots.shape)}")
    if num_rows is not None and slots.shape[0] != num_rows:
        raise ValueError(f"slots has {slots.shape[0]} entries for {num_rows} rows")
    if check_range and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= capacity:
            raise ValueError(f"slots must be -1 or in [0, {capacity}), got range [{lo}, {hi}]")


def check_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                token_ids: torch.Tensor | None, tid2eid: torch.Tensor | None,
                check_range: bool = True) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if bias is not None and (bias.shape != (num_experts,) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be fp32 [{num_experts}], got {bias.dtype} {tuple(bias.shape)}")
    if tid2eid is None:
        return
    if token_ids is None or token_ids.dim() != 1 or token_ids.shape[0] != logits.shape[0]:
        raise ValueError("hash routing needs token_ids of shape [T]")
    if tid2eid.dim() != 2 or tid2eid.shape[1] != top_k or tid2eid.dtype.is_floating_point:
        raise ValueError(f"tid2eid must be int [V, {top_k}], got {tid2eid.dtype} {tuple(tid2eid.shape)}")
    if check_range and token_ids.numel():
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi >= tid2eid.shape[0]:
            raise ValueError(f"token_ids must be in [0, {tid2eid.shape[0]}), got [{lo}, {hi}]")


def check_expert_ids(expert_ids: torch.Tensor, num_experts: int, check_range: bool) -> None:
    if expert_ids.dim() != 2 or expert_ids.dtype.is_floating_point:
        raise ValueError(f"expert_ids must be int [T, k], got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    if check_range and expert_ids.numel():
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert ids must be in [0, {num_experts}), got [{lo}, {hi}]")


# ---- quantized GEMMs ------------------------------------------------------------------------

FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.uint8)
FP4_WEIGHT_DTYPES = (torch.int8, torch.uint8)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_act_quant(x: torch.Tensor, group: int, op: str = "act_quant_fp8") -> None:
    if x.dim() < 1 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: x must be a float tensor [..., K] of {FLOAT_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    if group < 1 or group & (group - 1):
        raise ValueError(f"{op}: the activation group must be a power of two, got {group}")


def _check_gemm_input(op: str, x: torch.Tensor, k: int, out_dtype: torch.dtype | None, act_group: int) -> None:
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: x must be [M, K] of {FLOAT_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != k:
        raise ValueError(f"{op}: x has K={x.shape[1]} but the weight has K={k}")
    if out_dtype is not None:
        check_out_dtype(out_dtype)
    check_act_quant(x, act_group, op)


def _check_experts(op: str, weight: torch.Tensor, offsets: torch.Tensor | None, rows: int) -> None:
    """Dense ops take a 2-D weight; grouped ones a 3-D [E, ...] stack and offsets [E]."""
    if offsets is None:
        if weight.dim() != 2:
            raise ValueError(f"{op}: weight must be 2-D, got {tuple(weight.shape)}")
        return
    if weight.dim() != 3:
        raise ValueError(f"{op}: weight must be [E, N, ...], got {tuple(weight.shape)}")
    check_offsets(op, offsets, weight.shape[0], rows)


def check_offsets(op: str, offsets: torch.Tensor, num_experts: int, rows: int) -> None:
    """offsets [E] int: cumulative row ends, non-decreasing, within [0, rows]. The values are
    checked only on the host: reading CUDA offsets would sync with the device."""
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64) or offsets.shape[0] != num_experts:
        raise ValueError(f"{op}: offsets must be int32 [{num_experts}], got {offsets.dtype} {tuple(offsets.shape)}")
    if num_experts and not offsets.is_cuda:
        ends = offsets.contiguous().numpy()                 # numpy: ~4x cheaper than torch ops here
        if ends[0] < 0 or bool((ends[1:] < ends[:-1]).any()) or int(ends[-1]) > rows:
            raise ValueError(f"{op}: offsets must be non-decreasing cumulative ends within [0, {rows}], "
                             f"got {offsets.tolist()}")


def _check_scale(op: str, scale: torch.Tensor, expected: tuple[int, ...]) -> None:
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"{op}: scale must be one of {SCALE_DTYPES}, got {scale.dtype}")
    if tuple(scale.shape) != expected:
        raise ValueError(f"{op}: scale must have shape {expected}, got {tuple(scale.shape)}")


def check_fp8_gemm(op: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   offsets: torch.Tensor | None, out_dtype: torch.dtype | None, act_group: int) -> None:
    """weight e4m3 [(E,) N, K], scale [(E,) ceil(N/bN), ceil(K/bK)], x [M, K]."""
    if weight.dtype not in FP8_WEIGHT_DTYPES:
        raise ValueError(f"{op}: weight must be one of {FP8_WEIGHT_DTYPES}, got {weight.dtype}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"{op}: block must be two positive ints (bN, bK), got {block}")
    _check_experts(op, weight, offsets, x.shape[0] if x.dim() else 0)
    n, k = weight.shape[-2:]
    _check_gemm_input(op, x, k, out_dtype, act_group)
    _check_scale(op, scale, (*weight.shape[:-2], _cdiv(n, block[0]), _cdiv(k, block[1])))


def check_fp4_gemm(op: str, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int,
                   offsets: torch.Tensor | None, out_dtype: torch.dtype | None, act_group: int) -> None:
    """packed e2m1 pairs [(E,) N, K/2], scale [(E,) N, ceil(K/group)], x [M, K]."""
    if packed.dtype not in FP4_WEIGHT_DTYPES:
        raise ValueError(f"{op}: packed weight must be one of {FP4_WEIGHT_DTYPES}, got {packed.dtype}")
    if group < 2 or group % 2:
        raise ValueError(f"{op}: the FP4 scale group must be a positive even number, got {group}")
    _check_experts(op, packed, offsets, x.shape[0] if x.dim() else 0)
    n, k = packed.shape[-2], 2 * packed.shape[-1]
    _check_gemm_input(op, x, k, out_dtype, act_group)
    _check_scale(op, scale, (*packed.shape[:-2], n, _cdiv(k, group)))
