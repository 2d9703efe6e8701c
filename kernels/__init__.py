"""ringserve kernels: the only ops engine code imports.

Each op dispatches once on its tensors' device (rules in ``kernels.devices``: one device for all
arguments; CUDA tensors need the GPU toolkit, never falling back to the CPU path):
- KV cache and MoE routing: CUDA -> CuPy RawModule kernels (kernels/cuda/*.cu), CPU -> numba.
- Quantized GEMMs (FP8 block-scaled / packed FP4 weights) and activation fake-quantization:
  CUDA -> Triton (kernels/triton/quant_gemm.py), CPU -> numba tile decode + torch mm.
Semantics are defined by ``kernels.reference``; KV record layouts and numeric rules by
``kernels.formats``.
"""
from __future__ import annotations

import torch

from kernels import cpu_kv, cpu_quant_gemm, cpu_routing
from kernels.devices import backend
from kernels.formats import FORMAT_NAMES, KVFormat, get_format
from kernels.reference import ACT_GROUP, FP4_GROUP

__all__ = ["FORMAT_NAMES", "KVFormat", "get_format", "quantize", "dequantize", "quantize_scatter",
           "gather_dequantize", "route", "permute", "act_quant_fp8", "fp8_linear", "fp4_linear",
           "fp8_grouped_mm", "fp4_grouped_mm"]


def _cupy(op: str, **tensors: torch.Tensor | None) -> bool:
    return backend(op, "cupy", **tensors) == "cuda"


def _triton(op: str, **tensors: torch.Tensor | None) -> bool:
    return backend(op, "triton", **tensors) == "cuda"


# ---- KV cache -------------------------------------------------------------------------------

def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [N, D] float -> records uint8 [N, record_bytes] in format ``fmt``."""
    if _cupy("quantize", x=x):
        from kernels import cuda_kv
        return cuda_kv.quantize(x, fmt)
    return cpu_kv.quantize(x, fmt)


def dequantize(records: torch.Tensor, fmt: str, out_dtype: torch.dtype = torch.float32,
               dim: int | None = None) -> torch.Tensor:
    """records uint8 [N, record_bytes] -> [N, D] in ``out_dtype`` (D inferred unless given)."""
    if _cupy("dequantize", records=records):
        from kernels import cuda_kv
        return cuda_kv.dequantize(records, fmt, out_dtype, dim)
    return cpu_kv.dequantize(records, fmt, out_dtype, dim)


def quantize_scatter(x: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor, fmt: str) -> None:
    """Quantize x [N, D] into pool uint8 [num_blocks, block_size, record_bytes] in place.

    Row i goes to slot slot_mapping[i] = block * block_size + offset; -1 skips the row.
    """
    if _cupy("quantize_scatter", x=x, pool=pool, slot_mapping=slot_mapping):
        from kernels import cuda_kv
        return cuda_kv.quantize_scatter(x, pool, slot_mapping, fmt)
    return cpu_kv.quantize_scatter(x, pool, slot_mapping, fmt)


def gather_dequantize(pool: torch.Tensor, slots: torch.Tensor, fmt: str,
                      out_dtype: torch.dtype = torch.float32, dim: int | None = None) -> torch.Tensor:
    """Dequantize slots int64 [M] of the pool -> [M, D]; slot -1 reads as a zero row."""
    if _cupy("gather_dequantize", pool=pool, slots=slots):
        from kernels import cuda_kv
        return cuda_kv.gather_dequantize(pool, slots, fmt, out_dtype, dim)
    return cpu_kv.gather_dequantize(pool, slots, fmt, out_dtype, dim)


# ---- MoE routing ----------------------------------------------------------------------------

def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling_factor: float,
          token_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing: (weights fp32 [T, k], expert_ids int32 [T, k]); see reference.route."""
    if _cupy("route", logits=logits, bias=bias, token_ids=token_ids, tid2eid=tid2eid):
        from kernels import cuda_routing
        return cuda_routing.route(logits, bias, top_k, routed_scaling_factor, token_ids, tid2eid)
    return cpu_routing.route(logits, bias, top_k, routed_scaling_factor, token_ids, tid2eid)


def permute(expert_ids: torch.Tensor, num_experts: int,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts [E], offsets [E+1], order [T*k], inverse [T*k]), int32; see reference.permute."""
    if _cupy("permute", expert_ids=expert_ids):
        from kernels import cuda_routing
        return cuda_routing.permute(expert_ids, num_experts)
    return cpu_routing.permute(expert_ids, num_experts)


# ---- quantized GEMMs ------------------------------------------------------------------------

def act_quant_fp8(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """Fake-quantize x [..., K] to e4m3 with a ue8m0 scale per ``group`` along K (quant ->
    dequant, in x.dtype); NaN/Inf rules in reference.act_quant_fp8."""
    if _triton("act_quant_fp8", x=x):
        from kernels.triton import quant_gemm
        return quant_gemm.act_quant_fp8(x, group)
    return cpu_quant_gemm.act_quant_fp8(x, group)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
               act_quant: bool = False, out_dtype: torch.dtype | None = None,
               act_group: int = ACT_GROUP) -> torch.Tensor:
    """x [M, K] @ dequant(weight e4m3 [N, K], scale [ceil(N/bN), ceil(K/bK)])^T -> [M, N].

    act_quant fake-quantizes x first (per ``act_group``); fp32 accumulation; out_dtype defaults
    to x.dtype. See the quantized-GEMM section of kernels/reference.py.
    """
    if _triton("fp8_linear", x=x, weight=weight, scale=scale):
        from kernels.triton import quant_gemm
        return quant_gemm.fp8_linear(x, weight, scale, block, act_quant, out_dtype, act_group)
    return cpu_quant_gemm.fp8_linear(x, weight, scale, block, act_quant, out_dtype, act_group)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, act_quant: bool = False,
               out_dtype: torch.dtype | None = None, group: int = FP4_GROUP,
               act_group: int = ACT_GROUP) -> torch.Tensor:
    """x [M, K] @ dequant(packed e2m1 int8 [N, K/2], scale [N, ceil(K/group)])^T -> [M, N]."""
    if _triton("fp4_linear", x=x, packed=packed, scale=scale):
        from kernels.triton import quant_gemm
        return quant_gemm.fp4_linear(x, packed, scale, act_quant, out_dtype, group, act_group)
    return cpu_quant_gemm.fp4_linear(x, packed, scale, act_quant, out_dtype, group, act_group)


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   block: tuple[int, int] = (128, 128), act_quant: bool = False,
                   out_dtype: torch.dtype | None = None, act_group: int = ACT_GROUP) -> torch.Tensor:
    """MoE: rows [offsets[e-1], offsets[e]) of x [S, K] times dequant(weight[e])^T, weight e4m3
    [E, N, K], scale [E, ceil(N/bN), ceil(K/bK)], offsets int32 [E] cumulative ends (as
    F.grouped_mm's offs) -> [S, N]; rows at or past offsets[-1] are zero."""
    if _triton("fp8_grouped_mm", x=x, weight=weight, scale=scale, offsets=offsets):
        from kernels.triton import quant_gemm
        return quant_gemm.fp8_grouped_mm(x, weight, scale, offsets, block, act_quant, out_dtype, act_group)
    return cpu_quant_gemm.fp8_grouped_mm(x, weight, scale, offsets, block, act_quant, out_dtype, act_group)


def fp4_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   act_quant: bool = False, out_dtype: torch.dtype | None = None, group: int = FP4_GROUP,
                   act_group: int = ACT_GROUP) -> torch.Tensor:
    """MoE: rows [offsets[e-1], offsets[e]) of x [S, K] times dequant(packed[e])^T, packed int8
    [E, N, K/2], scale [E, N, ceil(K/group)], offsets int32 [E] -> [S, N]; rows at or past
    offsets[-1] are zero."""
    if _triton("fp4_grouped_mm", x=x, packed=packed, scale=scale, offsets=offsets):
        from kernels.triton import quant_gemm
        return quant_gemm.fp4_grouped_mm(x, packed, scale, offsets, act_quant, out_dtype, group, act_group)
    return cpu_quant_gemm.fp4_grouped_mm(x, packed, scale, offsets, act_quant, out_dtype, group, act_group)
