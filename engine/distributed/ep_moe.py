"""Expert-parallel routed MoE: logical→physical mapping, dispatch, local grouped compute, combine.

The caller has routed already (kernels.route: weights [T, k] fp32, expert_ids [T, k] LOGICAL
ids) and adds the shared expert itself (under DP attention each rank computes it for its own
tokens). This module:
1. records per-step token counts per logical expert (what EPLB rebalances on);
2. maps each choice to a PHYSICAL slot: expert e has replica_count[e] replicas in
   logical_to_physical[e, :replica_count[e]], and (token t, rank r) uses replica (t + r) mod
   replica_count[e] — a pure function of the batch, so results never depend on timing, and
   consecutive tokens (and ranks with one decode token each) spread over the replicas;
3. dispatches through an All2All backend, calls `local_experts(x_sorted [S, H],
   counts [L]) -> [S, H]` for this rank's L slots, and combines.

Every replica of an expert holds the same weights, so the replica choice never changes a
token's result. Lockstep: `forward` runs collectives, so every rank calls it for every MoE
layer of every step in the same order, with T = 0 on an idle rank.
"""

from __future__ import annotations

from typing import Callable

import torch

from .all2all import All2All

LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def map_to_physical(expert_ids: torch.Tensor, logical_to_physical: torch.Tensor, replica_count: torch.Tensor,
                    salt: int) -> torch.Tensor:
    """expert_ids [T, k] logical, logical_to_physical [E, R] (-1 padded), replica_count [E] ->
    slots [T, k] int64: replica (t + salt) mod replica_count[e] of expert e."""
    ids = expert_ids.long()
    t = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)  # [T, 1]
    replica = (t + salt) % replica_count[ids]  # [T, k]
    return logical_to_physical[ids, replica]


class ExpertParallelMoE:
    """The routed experts of one MoE layer, spread over the a2a's group."""

    def __init__(self, a2a: All2All, local_experts: LocalExperts, logical_to_physical: torch.Tensor,
                 replica_count: torch.Tensor):
        self.a2a = a2a
        self.local_experts = local_experts
        self.num_experts = replica_count.shape[0]
        self.set_placement(logical_to_physical, replica_count)
        # [E] tokens routed since take_load(), on the routing device (no host sync per step)
        self.load = torch.zeros(self.num_experts, dtype=torch.long, device=logical_to_physical.device)

    def set_placement(self, logical_to_physical: torch.Tensor, replica_count: torch.Tensor) -> None:
        """Adopt a new placement (after EPLB migrated the weights) — on every rank at the same step."""
        if replica_count.shape != (self.num_experts,) or int(replica_count.min()) < 1:
            raise ValueError("every logical expert needs at least one replica")
        if int(logical_to_physical.max()) >= self.a2a.layout.num_slots:
            raise ValueError(f"placement uses slots beyond the layout's {self.a2a.layout.num_slots}")
        self.logical_to_physical = logical_to_physical.long()  # [E, R]
        self.replica_count = replica_count.long()  # [E]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights [T, k] fp32, expert_ids [T, k] logical -> routed output [T, H]."""
        self.record(expert_ids)
        slots = map_to_physical(expert_ids, self.logical_to_physical, self.replica_count, self.a2a.rank)
        d = self.a2a.dispatch(x, slots, weights)
        y = self.local_experts(d.x, d.counts)  # [S, H]
        return self.a2a.combine(y, d)

    def record(self, expert_ids: torch.Tensor) -> None:
        flat = expert_ids.reshape(-1).long()
        self.load.index_add_(0, flat, torch.ones_like(flat))

    def take_load(self) -> torch.Tensor:
        """[E] this rank's tokens per logical expert since the last call; resets the counter."""
        load, self.load = self.load, torch.zeros_like(self.load)
        return load
