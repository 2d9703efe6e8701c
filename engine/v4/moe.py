"""DeepSeek-V4 MoE: sqrt-softplus router (learned top-k or tid2eid hash), clamped SwiGLU experts,
one shared expert. The routed experts are a `RoutedExperts` stack (engine/linear.py: w13
[E, 2I, H] gate rows then up rows, w2 [E, H, I], dense or FP8/FP4 as stored); a step runs two
grouped GEMMs over the expert-sorted token slots. The router stays fp32 and dense; the shared
expert's projections are `Linear`s (FP8 in the release)."""

from __future__ import annotations

import torch
from torch import nn

import kernels

from ..config import ModelConfig
from ..linear import Linear, RoutedExperts
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
        self.experts = RoutedExperts(e, h, i, cfg.swiglu_limit)
        # Under expert parallelism, the dispatch to the ranks owning each token's experts
        # (engine/distributed/expert_parallel.py); None: every expert is here.
        self.parallel = None
        if cfg.n_shared_experts:
            self.shared_w1 = Linear(h, i)
            self.shared_w3 = Linear(h, i)
            self.shared_w2 = Linear(i, h)

    def route(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, k], logical expert ids int32 [T, k]) for x [T, H]."""
        cfg = self.cfg
        logits = kernels.dense_linear(x.float(), self.gate.float(), allow_bf16=False)  # [T, E] fp32, exact
        return kernels.route(
            logits,
            None if self.hash_routing else self.gate_bias.float(),
            cfg.num_experts_per_tok,
            cfg.routed_scaling_factor,
            token_ids=token_ids if self.hash_routing else None,
            tid2eid=self.tid2eid if self.hash_routing else None,
        )

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert: x [T, H] → [T, H]."""
        act = clamped_swiglu(self.shared_w1(x), self.shared_w3(x), self.cfg.swiglu_limit)  # [T, I]
        return self.shared_w2(act)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H] → [T, H]; T may be 0."""
        weights, expert_ids = self.route(x, token_ids)
        if self.parallel is not None:
            out = self.parallel(x, weights, expert_ids)
        else:
            out = self._experts(x, weights, expert_ids)
        if self.cfg.n_shared_experts:
            out = out + self.shared(x)
        return out

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Grouped GEMMs over expert-sorted (token, choice) slots: no host sync, no Python loop
        over experts. x: [T, H]; weights, expert_ids: [T, k]. Needs every expert on this rank
        (expert e in slot e); a rank holding a share runs its experts through ExpertParallelMoE
        with `self.experts.local_experts`."""
        if not self.experts.holds_all:
            raise RuntimeError(f"this MoE holds {self.experts.num_local_experts} of {self.cfg.n_routed_experts} "
                               "experts: route it through ExpertParallelMoE")
        t, k = expert_ids.shape
        _, offsets, order, inverse = kernels.permute(expert_ids, self.cfg.n_routed_experts)
        order = order.long()
        ends = offsets[1:].to(torch.int32)  # [E] cumulative slot counts
        slots = x[order // k]  # [T·k, H] in expert order
        y = self.experts(slots, ends)  # [T·k, H]
        y = y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        # Back to (token, choice) order and sum the k choices in a fixed order (explicit H: T may be 0).
        return y[inverse.long()].view(t, k, x.shape[-1]).sum(dim=1).to(x.dtype)
