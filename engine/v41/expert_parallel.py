"""Expert-parallel dispatch of V4.1's routed experts, with the one-rank result to the bit.

V4's dispatcher (engine/distributed/ep_moe.py) sends tokens, lets the owner compute the bare expert output
and applies the routing weight after the combine. V4.1's expert applies the weight to its fp32
activation *before* w2, and the one-rank MoE sums the bf16 expert outputs in fp32 in ascending
expert order. So here:
  * each (token, choice) travels as one row: the token's bf16 hidden state followed by its fp32
    routing weight's bits as two bf16 lanes (`pack_rows`), dispatched with k = 1 — the all-to-all
    backends only move rows, they never look inside;
  * the owner runs `V41Experts.run` on those rows, weight included (`local_experts`);
  * the combine hands back every choice's bf16 output (its weight is 1: exact), and the caller's
    rank sums the k choices of each token in fp32 in ascending expert order (`ascending_sum`).
A row's expert output does not depend on which other rows share the call (exact block GEMMs,
elementwise ops), so the result equals one rank's for any placement, replica choice or backend.

Only the backbone's MoE layers are expert-parallel; the DSpark stages' small MoEs (their own
expert count) stay whole on every rank, so drafting runs no collective (engine/distributed/expert_parallel.py
`moe_layer_ids`).
"""

from __future__ import annotations

import torch

from ..distributed.ep_moe import ExpertParallelMoE, map_to_physical

WEIGHT_LANES = 2  # an fp32 routing weight rides as two bf16 lanes after the hidden state


def pack_rows(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [T, H] bf16, weights [T, k] fp32 → [T·k, H + 2] bf16 in (token, choice) order."""
    k = weights.shape[1]
    bits = weights.float().reshape(-1, 1).view(torch.bfloat16)  # [T·k, 2]: the fp32 bits, reinterpreted
    return torch.cat([x.repeat_interleave(k, dim=0), bits], dim=1)


def unpack_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, H + 2] bf16 → (x [S, H] bf16, routing weight [S, 1] fp32)."""
    h = rows.shape[1] - WEIGHT_LANES
    return rows[:, :h], rows[:, h:].contiguous().view(torch.float32)


def ascending_sum(per_choice: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """per_choice [T, k, H] bf16 outputs, expert_ids [T, k] (distinct per token) → [T, H] fp32:
    0 + the choices in ascending expert order, each added in fp32 — the one-rank MoE's order."""
    order = expert_ids.argsort(dim=1)  # [T, k]
    ordered = per_choice.gather(1, order.unsqueeze(-1).expand_as(per_choice))  # [T, k, H]
    y = torch.zeros(per_choice.shape[0], per_choice.shape[2], dtype=torch.float32, device=per_choice.device)
    for j in range(per_choice.shape[1]):
        y = y + ordered[:, j].float()
    return y


def local_experts(experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`experts` (V41Experts) on rows [S, H + 2] grouped by local slot (counts [L]; rows past
    counts.sum() are padding) → [S, H] bf16, zeros on padding rows."""
    x, weight = unpack_rows(rows)
    out = torch.zeros_like(x)
    begin = 0
    for slot, n in enumerate(counts.tolist()):
        if n:
            out[begin:begin + n] = experts.run(slot, x[begin:begin + n], weight[begin:begin + n])
        begin += n
    return out


class V41ExpertParallelMoE(ExpertParallelMoE):
    """The routed part of one V4.1 MoE layer over the group: [T, H] bf16 → fp32 [T, H] sums."""

    def __init__(self, a2a, experts, logical_to_physical: torch.Tensor, replica_count: torch.Tensor):
        super().__init__(a2a, lambda rows, counts: local_experts(experts, rows, counts), logical_to_physical,
                         replica_count)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16, weights [T, k] fp32, expert_ids [T, k] logical → [T, H] fp32."""
        self.record(expert_ids)
        t, k = expert_ids.shape
        slots = map_to_physical(expert_ids, self.logical_to_physical, self.replica_count, self.a2a.rank)  # [T, k]
        ones = weights.new_ones(t * k, 1)  # the weight is inside the rows already
        d = self.a2a.dispatch(pack_rows(x, weights), slots.reshape(-1, 1), ones)
        y = self.local_experts(d.x, d.counts)  # [S, H] bf16
        per_choice = self.a2a.combine(y, d).view(t, k, x.shape[1])  # [T, k, H] bf16
        return ascending_sum(per_choice, expert_ids)


def idle_forward(model) -> None:
    """A rank with no tokens this step: zero rows through every expert-parallel MoE layer, in
    the order a real forward visits them, so the group's collectives pair up."""
    cfg = model.cfg
    x = torch.zeros(0, cfg.hidden_size, dtype=torch.bfloat16, device=model.device)
    for block in model.layers:
        moe = block.ffn
        if moe.parallel is not None:
            w = torch.zeros(0, moe.topk, dtype=torch.float32, device=model.device)
            moe.parallel(x, w, torch.zeros(0, moe.topk, dtype=torch.long, device=model.device))
