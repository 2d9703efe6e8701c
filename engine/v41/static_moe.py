"""V4.1's MoE for the static decode step: no `unique().tolist()` over the routed experts, no
data-dependent shape.

The result is the eager MoE's (engine/v41/moe.py): each token's expert outputs (bf16) summed in
fp32 in ascending expert order, then the shared expert, one rounding to bf16. How the routed
products are formed depends on the numerics:
  * exact (the reference's fp64 block products): every expert runs on every row with the row's
    routing weight for it (0 where not chosen) and only the chosen rows are added. A row's expert
    output does not depend on the other rows, so the chosen rows get the eager bits; the cost is
    n_experts / top-k times the routed work, acceptable for the models exact numerics serve (an
    fp64 copy of every expert's weights is held anyway);
  * fast (the kernels' FP8/FP4 GEMMs): the (token, choice) pairs sorted by expert through two
    grouped GEMMs (`kernels.fp*_grouped_mm`, Triton on CUDA), then back to token order and
    summed per token in ascending expert order.
"""

from __future__ import annotations

import torch

import kernels

from . import numerics as nx
from .model import per_chunk
from .quant import fake_fp8


def static_moe(moe, x: torch.Tensor, groups) -> torch.Tensor:
    """[N, dim] bf16 → [N, dim] bf16; `groups`: the row groups of row-count-dependent calls."""
    weights, experts = per_chunk(moe.route, groups, x)  # [N, k] fp32, [N, k] logical ids
    routed = _every_expert if nx.current().exact else _grouped_experts
    y = routed(moe.experts, x, weights, experts)  # [N, dim] fp32
    y = y + per_chunk(moe.shared_experts, groups, x)
    return y.to(torch.bfloat16)


def _every_expert(experts, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Exact products: expert e (ascending) on all rows, added where a row chose it."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for slot, e in enumerate(experts.logical_ids):  # one rank holds every expert, in order
        mine = chosen == e  # [N, k]: at most one True per row
        weight = torch.where(mine, weights, 0.0).sum(dim=-1, keepdim=True)  # exactly its weight (+ zeros)
        out = experts.run(slot, x, weight)  # [N, dim] bf16
        y = torch.where(mine.any(dim=-1, keepdim=True), y + out.float(), y)
    return y


def _grouped_experts(experts, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The kernels' products over the (token, choice) pairs sorted by expert."""
    n, k = chosen.shape
    flat = chosen.reshape(-1)  # [P = N·k]
    order = torch.sort(flat, stable=True).indices  # pairs by expert, then by (token, choice)
    counts = torch.zeros(experts.num_experts, dtype=torch.long, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0).to(torch.int32)  # [E] cumulative row ends
    h = _grouped_product(experts.w13, x[torch.div(order, k, rounding_mode="floor")], ends)  # [P, 2I] bf16
    limit, inter = experts.swiglu_limit, experts.inter
    gate = h[:, :inter].float().clamp(max=limit)
    up = h[:, inter:].float().clamp(-limit, limit)
    act = (weights.reshape(-1)[order][:, None] * (nx.silu(gate) * up)).to(torch.bfloat16)  # weight before w2
    out = _grouped_product(experts.w2, act, ends)  # [P, dim] bf16, expert order
    per_pair = torch.empty_like(out).index_copy_(0, order, out).view(n, k, -1)  # (token, choice) order
    ascending = chosen.argsort(dim=-1)  # each token's choices by expert id
    per_pair = per_pair.gather(1, ascending[..., None].expand(-1, -1, per_pair.shape[-1]))
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(k):
        y = y + per_pair[:, j].float()
    return y


def _grouped_product(w, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows [ends[e−1], ends[e]) of x through expert e, with V4.1's activation quantization, as
    engine/v41/linear.py `fast_quant_gemm` computes one expert."""
    if w.fmt.kind == "fp8":
        return kernels.fp8_grouped_mm(x, w.weight, w.scale, ends, w.fmt.block, act_quant=True, out_dtype=torch.bfloat16)
    if w.fmt.kind == "fp4":
        return kernels.fp4_grouped_mm(x, w.weight, w.scale, ends, act_quant=True, out_dtype=torch.bfloat16,
                                      group=w.fmt.block[1])
    return kernels.dense_grouped_mm(fake_fp8(x).float(), w.weight.float(), ends).to(torch.bfloat16)
