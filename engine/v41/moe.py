"""V4.1's MoE: sqrt-softplus router over logits / gate_temp (the bias picks the experts, the raw
scores weight them; no hash layers), clamped-SwiGLU experts with the routing weight applied to
the fp32 activation before w2, one shared expert. Expert outputs (bf16) accumulate in fp32 in
ascending expert order, the shared expert last, then one rounding to bf16.

`parallel` is the hook an expert-parallel dispatch would set (the routed part only, the sum in
the same order); V4.1 has none yet, so the loader refuses --enable-expert-parallel.
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
        self.experts = V41Experts(n_experts, d, i, cfg.swiglu_limit)
        self.shared_experts = SharedExpert(d, i, cfg.swiglu_limit)
        self.parallel = None  # an expert-parallel dispatch (none for V4.1 yet: engine/v41/weights.py refuses EP)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim] → (weights fp32 [T, k], logical experts [T, k])."""
        cfg = self.cfg
        scores = nx.softplus(nx.fp32_gemm(x, self.gate.weight) / cfg.v41.gate_temp).sqrt()
        experts = (scores + self.gate.bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, dim] bf16 → [T, dim] bf16."""
        weights, experts = self.route(x)
        if self.parallel is not None:
            y = self.parallel(x, weights, experts)
        else:
            y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            slot_of = self.experts.slots_of
            for e in torch.unique(experts).tolist():  # ascending expert order
                tokens, choice = torch.where(experts == e)
                y[tokens] += self.experts.run(slot_of(e)[0], x[tokens], weights[tokens, choice, None])
        y += self.shared_experts(x)
        return y.to(torch.bfloat16)
