"""DeepSeek-V4 MoE: sqrt-softplus router (learned top-k or tid2eid hash), clamped SwiGLU experts,
one shared expert. Routed experts are stored stacked: w13 [E, 2I, H] (gate rows then up rows)
and w2 [E, H, I]; a step runs two grouped GEMMs over the expert-sorted token slots. On CPU the
stacks are laid out so that their [E, K, N] transposes are contiguous (what CPU grouped_mm is
fast on); on GPU they stay row-major, whose transposes are the column-major operand cuBLAS wants."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels

from .config import ModelConfig
from .layers import clamped_swiglu


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hash_routing: bool):
        super().__init__()
        self.cfg = cfg
        self.hash_routing = hash_routing
        e, i, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate = nn.Parameter(torch.empty(e, h))
        if hash_routing:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int32))
            self.gate_bias = None
        else:
            self.gate_bias = nn.Parameter(torch.zeros(e))  # fp32, used for selection only
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        if cfg.n_shared_experts:
            self.shared_w1 = nn.Parameter(torch.empty(i, h))
            self.shared_w3 = nn.Parameter(torch.empty(i, h))
            self.shared_w2 = nn.Parameter(torch.empty(h, i))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H] → [T, H]."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.gate.float())  # [T, E] fp32
        weights, expert_ids = kernels.route(
            logits,
            None if self.hash_routing else self.gate_bias.float(),
            cfg.num_experts_per_tok,
            cfg.routed_scaling_factor,
            token_ids=token_ids if self.hash_routing else None,
            tid2eid=self.tid2eid if self.hash_routing else None,
        )
        out = self._experts(x, weights, expert_ids)
        if cfg.n_shared_experts:
            act = clamped_swiglu(F.linear(x, self.shared_w1), F.linear(x, self.shared_w3), cfg.swiglu_limit)
            out = out + F.linear(act, self.shared_w2)
        return out

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Grouped GEMMs over expert-sorted (token, choice) slots: no host sync, no Python loop
        over experts. x: [T, H]; weights, expert_ids: [T, k]."""
        t, k = expert_ids.shape
        inter = self.cfg.moe_intermediate_size
        _, offsets, order, inverse = kernels.permute(expert_ids, self.cfg.n_routed_experts)
        order = order.long()
        ends = offsets[1:].to(torch.int32)  # [E] cumulative slot counts
        slots = x[order // k]  # [T·k, H] in expert order
        h = F.grouped_mm(slots, self.w13.transpose(1, 2), offs=ends)  # [T·k, 2I]
        act = clamped_swiglu(h[:, :inter], h[:, inter:], self.cfg.swiglu_limit)
        y = F.grouped_mm(act, self.w2.transpose(1, 2), offs=ends)  # [T·k, H]
        y = y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        # Back to (token, choice) order and sum the k choices in a fixed order.
        return y[inverse.long()].view(t, k, -1).sum(dim=1).to(x.dtype)
