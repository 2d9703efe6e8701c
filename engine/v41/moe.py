"""V4.1's MoE: sqrt-softplus router over logits / gate_temp (the bias picks the experts, the raw
scores weight them; no hash layers), clamped-SwiGLU experts with the routing weight applied to
the fp32 activation before w2, one shared expert. Expert outputs (bf16) accumulate in fp32 in
ascending expert order, the shared expert last, then one rounding to bf16.

Image-span positions (DeepSeek-V4.1 vision) pick their experts with the second bias `gate.bias_vl`
(every Gate has one when the checkpoint has a vision tower, DSpark stages included, which never
use it); `image_mask` [T] bool marks them. Decode steps pass none: generated tokens are text.

Under expert parallelism `parallel` (engine/v41/expert_parallel.py) computes the routed part over
the group with the same sum in the same order; `forward_parallel` keeps the router and the shared
expert per chunk (their bits depend on the row count under reference numerics) and sends the
whole step's rows through the dispatch at once (a row's expert output does not depend on the rest).
"""

from __future__ import annotations

import torch
from torch import nn

from . import numerics as nx
from .linear import Param, QLinear, V41Experts


class SharedExpert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1, self.w2, self.w3 = QLinear(dim, inter), QLinear(inter, dim), QLinear(dim, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).float().clamp(max=self.limit)
        up = self.w3(x).float().clamp(-self.limit, self.limit)
        return self.w2((nx.silu(gate) * up).to(torch.bfloat16))


class MoE(nn.Module):
    def __init__(self, cfg, n_experts: int, topk: int):
        super().__init__()
        self.cfg, self.n_experts, self.topk = cfg, n_experts, topk
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Param(n_experts, d, dtype=torch.float32, bias=n_experts)  # REF holds the router in fp32
        if cfg.v41.vision is not None:
            self.gate.bias_vl = nn.Parameter(torch.empty(n_experts, dtype=torch.float32), requires_grad=False)
        self.experts = V41Experts(n_experts, d, i, cfg.swiglu_limit)
        self.shared_experts = SharedExpert(d, i, cfg.swiglu_limit)
        self.parallel = None  # V41ExpertParallelMoE under expert parallelism; None: every expert is here

    def route(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim], image_mask [T] bool or None → (weights fp32 [T, k], logical experts [T, k])."""
        cfg = self.cfg
        scores = nx.softplus(nx.fp32_gemm(x, self.gate.weight) / cfg.v41.gate_temp).sqrt()
        bias = self.gate.bias
        if image_mask is not None:
            bias = torch.where(image_mask[:, None], self.gate.bias_vl, bias)  # [T, n_experts]
        experts = (scores + bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, experts

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[T, dim] bf16 (image_mask [T] bool or None) → [T, dim] bf16."""
        if self.parallel is not None:
            return self.forward_parallel(x, lambda fn, *t: fn(*t), image_mask)
        weights, experts = self.route(x, image_mask)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        slot_of = self.experts.slots_of
        routing = experts.cpu()  # one read of the routing on a GPU (not one per expert)
        for e in torch.unique(routing).tolist():  # ascending expert order
            tokens, choice = (t.to(x.device) for t in torch.where(routing == e))
            y[tokens] += self.experts.run(slot_of(e)[0], x[tokens], weights[tokens, choice, None])
        y += self.shared_experts(x)
        return y.to(torch.bfloat16)

    def forward_parallel(self, x: torch.Tensor, per_chunk, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[T, dim] bf16 → [T, dim] bf16 through the expert-parallel dispatch; `per_chunk(fn, x)`
        applies a row-count-dependent fn the way the one-rank forward would (chunk by chunk)."""
        if image_mask is None:
            weights, experts = per_chunk(self.route, x)  # [T, k] each
        else:
            weights, experts = per_chunk(self.route, x, image_mask)
        y = self.parallel(x, weights, experts)  # [T, dim] fp32, ascending expert order
        y += per_chunk(self.shared_experts, x)
        return y.to(torch.bfloat16)
