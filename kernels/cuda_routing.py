"""CuPy launches of kernels/cuda/moe_routing.cu on torch CUDA tensors (on their device, on torch's
current stream there: see kernels/devices.py).

Scores use CUDA's expf/log1pf, so weights agree with the CPU reference to a few ulps, not bit
for bit; selection follows the same key order and tie rule.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels import checks
from kernels.cuda_names import NAME_EXPRESSIONS, ROUTE_PER_LANE
from kernels.devices import cupy_launch
from kernels.loader import load_module

WARPS_PER_BLOCK = 4
SCATTER_THREADS = 256   # permute_scatter assumes 8 warps


def _module():
    return load_module("moe_routing", name_expressions=NAME_EXPRESSIONS["moe_routing"])


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _run(name: str, device_tensor: torch.Tensor, grid: int, block: int, args: tuple) -> None:
    if grid == 0:
        return
    with cupy_launch(device_tensor):   # the module is loaded per device: look the kernel up inside
        _module().get_function(name)((grid,), (block,), args)


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling_factor: float,
          token_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_route(logits, bias, top_k, token_ids, tid2eid, check_range=False)
    logits = logits.contiguous()
    num_tokens, num_experts = logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=logits.device)
    dims = (np.int32(num_tokens), np.int32(num_experts), np.int32(top_k), np.float32(routed_scaling_factor))
    if tid2eid is not None:
        table = tid2eid.to(torch.int32).contiguous()    # pass int32 to avoid this copy
        tokens = token_ids.to(torch.int64).contiguous()
        args = (_ptr(logits), _ptr(tokens), _ptr(table), np.int64(table.shape[0])) + dims + (_ptr(weights), _ptr(ids))
        _run("route_hash", logits, (num_tokens + 127) // 128, 128, args)
        return weights, ids
    per_lane = next((p for p in ROUTE_PER_LANE if 32 * p >= num_experts), None)
    if per_lane is None or top_k > 32 * per_lane:
        raise ValueError(f"CUDA routing supports at most {32 * ROUTE_PER_LANE[-1]} experts")
    bias = None if bias is None else bias.contiguous()
    args = (_ptr(logits), _ptr(bias)) + dims + (_ptr(weights), _ptr(ids))
    grid = (num_tokens + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK
    _run(f"route_topk<{per_lane}>", logits, grid, 32 * WARPS_PER_BLOCK, args)
    return weights, ids


def permute(expert_ids: torch.Tensor, num_experts: int,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    checks.check_expert_ids(expert_ids, num_experts, check_range=False)
    flat = expert_ids.reshape(-1).to(torch.int32).contiguous()
    n, dev = flat.shape[0], flat.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    order = torch.empty(n, dtype=torch.int32, device=dev)
    inverse = torch.empty(n, dtype=torch.int32, device=dev)
    _run("permute_count", flat, max(1, min(1024, (n + 255) // 256)), 256, (_ptr(flat), np.int32(n), np.int32(num_experts), _ptr(counts)))
    _run("permute_offsets", flat, 1, 1, (_ptr(counts), np.int32(num_experts), _ptr(offsets)))
    _run("permute_scatter", flat, num_experts, SCATTER_THREADS,
         (_ptr(flat), np.int32(n), _ptr(offsets), _ptr(order), _ptr(inverse)))
    return counts, offsets, order, inverse
