"""ringserve kernels: the only ops engine code imports.

Each op dispatches once: to the CUDA (CuPy RawModule) implementation when its tensor lives on a
CUDA device and CuPy imports, otherwise to the CPU (numba) implementation. Semantics are defined
by ``kernels.reference``; record layouts and numeric rules by ``kernels.formats``.
"""
from __future__ import annotations

import functools

import torch

from kernels import cpu_kv, cpu_routing
from kernels.formats import FORMAT_NAMES, KVFormat, get_format

__all__ = ["FORMAT_NAMES", "KVFormat", "get_format", "quantize", "dequantize", "quantize_scatter",
           "gather_dequantize", "route", "permute"]


@functools.cache
def _cupy_importable() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and _cupy_importable()


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [N, D] float -> records uint8 [N, record_bytes] in format ``fmt``."""
    if _on_cuda(x):
        from kernels import cuda_kv
        return cuda_kv.quantize(x, fmt)
    return cpu_kv.quantize(x, fmt)


def dequantize(records: torch.Tensor, fmt: str, out_dtype: torch.dtype = torch.float32,
               dim: int | None = None) -> torch.Tensor:
    """records uint8 [N, record_bytes] -> [N, D] in ``out_dtype`` (D inferred unless given)."""
    if _on_cuda(records):
        from kernels import cuda_kv
        return cuda_kv.dequantize(records, fmt, out_dtype, dim)
    return cpu_kv.dequantize(records, fmt, out_dtype, dim)


def quantize_scatter(x: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor, fmt: str) -> None:
    """Quantize x [N, D] into pool uint8 [num_blocks, block_size, record_bytes] in place.

    Row i goes to slot slot_mapping[i] = block * block_size + offset; -1 skips the row.
    """
    if _on_cuda(pool):
        from kernels import cuda_kv
        return cuda_kv.quantize_scatter(x, pool, slot_mapping, fmt)
    return cpu_kv.quantize_scatter(x, pool, slot_mapping, fmt)


def gather_dequantize(pool: torch.Tensor, slots: torch.Tensor, fmt: str,
                      out_dtype: torch.dtype = torch.float32, dim: int | None = None) -> torch.Tensor:
    """Dequantize slots int64 [M] of the pool -> [M, D]; slot -1 reads as a zero row."""
    if _on_cuda(pool):
        from kernels import cuda_kv
        return cuda_kv.gather_dequantize(pool, slots, fmt, out_dtype, dim)
    return cpu_kv.gather_dequantize(pool, slots, fmt, out_dtype, dim)


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling_factor: float,
          token_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing: (weights fp32 [T, k], expert_ids int32 [T, k]); see reference.route."""
    if _on_cuda(logits):
        from kernels import cuda_routing
        return cuda_routing.route(logits, bias, top_k, routed_scaling_factor, token_ids, tid2eid)
    return cpu_routing.route(logits, bias, top_k, routed_scaling_factor, token_ids, tid2eid)


def permute(expert_ids: torch.Tensor, num_experts: int,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts [E], offsets [E+1], order [T*k], inverse [T*k]), int32; see reference.permute."""
    if _on_cuda(expert_ids):
        from kernels import cuda_routing
        return cuda_routing.permute(expert_ids, num_experts)
    return cpu_routing.permute(expert_ids, num_experts)
