"""Expert-parallel load balancing (EPLB): where each layer's experts and their replicas live.

DeepSeek's policy, global form (V4/V4.1 have no expert groups), written from its description:
1. replicate_experts: every logical expert gets one physical slot; each of the R redundant slots
   goes, one at a time, to the expert with the largest load per replica (argmax load/replicas);
2. balanced_packing: the replicas, each carrying load/replicas tokens, go heaviest first into the
   lightest rank that still has a free slot, so every rank ends with P/N slots (P = E + R).
Ties always go to the lowest index, so the result is a pure function of the load.

A Placement is what the routing needs (logical_to_physical, logical_replica_count) and what the
weights follow (physical_to_logical: slot p on rank p // (P/N) holds that logical expert's
weights). migration_plan/migrate_expert_weights move the weights from one placement to the next
over the process group with one all_to_all_single per weight tensor name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Placement:
    physical_to_logical: np.ndarray  # [L, P] int64
    logical_to_physical: np.ndarray  # [L, E, max_replicas] int64, -1 padded
    logical_replica_count: np.ndarray  # [L, E] int64, >= 1
    num_ranks: int

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logical_replica_count.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def layer_maps(self, layer: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(logical_to_physical [E, R], replica_count [E]) of one layer, for ExpertParallelMoE."""
        return (torch.as_tensor(self.logical_to_physical[layer], device=device),
                torch.as_tensor(self.logical_replica_count[layer], device=device))

    def local_experts(self, layer: int, rank: int) -> np.ndarray:
        """[P/N] the logical expert held in each of rank's slots."""
        s = self.slots_per_rank
        return self.physical_to_logical[layer, rank * s:(rank + 1) * s]


def identity_placement(num_layers: int, num_experts: int, num_ranks: int) -> Placement:
    """No redundancy: expert e in slot e on every layer."""
    p2l = np.tile(np.arange(num_experts, dtype=np.int64), (num_layers, 1))
    return _placement(p2l, num_experts, num_ranks)


def replicate_experts(load: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """load [L, E] -> (replica_of [L, P] logical expert of each replica, replica_index [L, P],
    replica_count [L, E]); replicas 0..E-1 are the experts themselves, the rest are redundant."""
    layers, experts = load.shape
    rows = np.arange(layers)
    replica_of = np.zeros((layers, num_physical), dtype=np.int64)
    replica_of[:, :experts] = np.arange(experts)
    replica_index = np.zeros((layers, num_physical), dtype=np.int64)
    count = np.ones((layers, experts), dtype=np.int64)
    for p in range(experts, num_physical):
        e = np.argmax(load / count, axis=1)  # [L] first maximum: lowest id on ties
        replica_of[:, p] = e
        replica_index[:, p] = count[rows, e]
        count[rows, e] += 1
    return replica_of, replica_index, count


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """weight [L, P] -> (pack [L, P], index_in_pack [L, P]); each pack gets exactly P/num_packs
    items, heaviest item first into the lightest pack that is not full."""
    layers, items = weight.shape
    per_pack = items // num_packs
    pack = np.empty((layers, items), dtype=np.int64)
    index = np.empty((layers, items), dtype=np.int64)
    for layer in range(layers):
        pack_weight = np.zeros(num_packs)
        pack_items = np.zeros(num_packs, dtype=np.int64)
        for item in np.argsort(-weight[layer], kind="stable"):  # heaviest first, lower index on ties
            p = int(np.argmin(np.where(pack_items < per_pack, pack_weight, np.inf)))
            pack[layer, item], index[layer, item] = p, pack_items[p]
            pack_weight[p] += weight[layer, item]
            pack_items[p] += 1
    return pack, index


def rebalance(load: np.ndarray, num_ranks: int, num_redundant: int) -> Placement:
    """load [L, E] tokens per logical expert -> Placement with P = E + num_redundant slots."""
    load = np.asarray(load, dtype=np.float64)
    layers, experts = load.shape
    num_physical = experts + num_redundant
    if num_redundant < 0 or num_physical % num_ranks:
        raise ValueError(f"{experts} experts + {num_redundant} redundant do not split over {num_ranks} ranks")
    rows = np.arange(layers)[:, None]
    replica_of, replica_index, count = replicate_experts(load, num_physical)
    pack, index = balanced_packing(load[rows, replica_of] / count[rows, replica_of], num_ranks)
    slot = pack * (num_physical // num_ranks) + index  # [L, P] final slot of each replica
    p2l = np.empty_like(replica_of)
    p2l[rows, slot] = replica_of
    l2p = np.full((layers, experts, int(count.max())), -1, dtype=np.int64)
    l2p[rows, replica_of, replica_index] = slot
    return Placement(p2l, l2p, count, num_ranks)


def _placement(p2l: np.ndarray, num_experts: int, num_ranks: int) -> Placement:
    """Derive the logical-side maps from physical_to_logical (replicas in ascending slot order)."""
    layers, slots = p2l.shape
    if slots % num_ranks:
        raise ValueError(f"{slots} slots do not split over {num_ranks} ranks")
    count = np.zeros((layers, num_experts), dtype=np.int64)
    for layer in range(layers):
        count[layer] = np.bincount(p2l[layer], minlength=num_experts)
    l2p = np.full((layers, num_experts, int(count.max())), -1, dtype=np.int64)
    for layer in range(layers):
        seen = np.zeros(num_experts, dtype=np.int64)
        for p, e in enumerate(p2l[layer]):
            l2p[layer, e, seen[e]] = p
            seen[e] += 1
    return Placement(p2l, l2p, count, num_ranks)


def rank_loads(load: np.ndarray, placement: Placement) -> np.ndarray:
    """load [L, E] -> [L, N] tokens each rank computes, each expert's load split evenly over its
    replicas (what the (token + rank) mod replicas choice gives on average)."""
    rows = np.arange(placement.num_layers)[:, None]
    p2l = placement.physical_to_logical
    per_slot = np.asarray(load, dtype=np.float64)[rows, p2l] / placement.logical_replica_count[rows, p2l]
    return per_slot.reshape(placement.num_layers, placement.num_ranks, -1).sum(-1)


def imbalance(load: np.ndarray, placement: Placement) -> np.ndarray:
    """[L] max over mean of rank_loads (1.0 = perfectly balanced; 1.0 for an idle layer)."""
    per_rank = rank_loads(load, placement)
    mean = per_rank.mean(axis=1)
    return np.where(mean > 0, per_rank.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


@dataclass(frozen=True)
class Move:
    """New slot `slot` (global, in the new placement) of layer `layer` gets the weights that rank
    `from_rank` holds in its local slot `from_slot` of the old placement."""

    layer: int
    slot: int
    from_rank: int
    from_slot: int


def migration_plan(old: Placement, new: Placement) -> list[list[Move]]:
    """Per destination rank, the moves that give it its new slots' weights. A (rank, local slot)
    whose logical expert is unchanged is not moved; a rank copies locally when it already holds
    the expert elsewhere; otherwise the source is one of the old holders, chosen round-robin by
    slot so that popular experts' senders share the work."""
    if old.num_ranks != new.num_ranks or old.num_layers != new.num_layers:
        raise ValueError("placements differ in ranks or layers")
    so, sn = old.slots_per_rank, new.slots_per_rank
    plan: list[list[Move]] = [[] for _ in range(new.num_ranks)]
    for layer in range(new.num_layers):
        for rank in range(new.num_ranks):
            held = old.local_experts(layer, rank)
            for i, e in enumerate(new.local_experts(layer, rank)):
                if i < so and held[i] == e:
                    continue
                mine = np.flatnonzero(held == e)
                if mine.size:
                    src_rank, src_slot = rank, int(mine[0])
                else:
                    holders = np.flatnonzero(old.physical_to_logical[layer] == e)
                    src_rank, src_slot = divmod(int(holders[(rank * sn + i) % holders.size]), so)
                plan[rank].append(Move(layer, rank * sn + i, src_rank, src_slot))
    return plan


def migrate_expert_weights(tensors: dict[str, torch.Tensor], plan: list[list[Move]], layer: int,
                           new_slots_per_rank: int, rank: int, group: dist.ProcessGroup | None = None,
                           ) -> dict[str, torch.Tensor]:
    """tensors: this rank's old weights of one layer, name -> [S_old, ...] (one row per local slot)
    -> the same names as [S_new, ...] for the new placement. Every rank calls this for the same
    layer with the same plan (a collective: one all_to_all_single per name, in sorted name order).
    Holds the old and the new copy of one layer at a time."""
    world = len(plan)
    sends = [[m for m in plan[d] if m.layer == layer and m.from_rank == rank] if d != rank else []
             for d in range(world)]
    mine = [m for m in plan[rank] if m.layer == layer]
    recvs = [[m for m in mine if m.from_rank == s] if s != rank else [] for s in range(world)]
    moved = {m.slot - rank * new_slots_per_rank for m in mine}
    out = {}
    for name in sorted(tensors):
        old = tensors[name]
        new = old.new_empty((new_slots_per_rank, *old.shape[1:]))
        for i in range(new_slots_per_rank):
            if i not in moved:
                new[i] = old[i]  # unchanged slot
        for m in mine:
            if m.from_rank == rank:
                new[m.slot - rank * new_slots_per_rank] = old[m.from_slot]  # local copy
        _exchange(old, new, sends, recvs, rank * new_slots_per_rank, group)
        out[name] = new
    return out


def _exchange(old: torch.Tensor, new: torch.Tensor, sends: list[list[Move]], recvs: list[list[Move]],
              first_slot: int, group: dist.ProcessGroup | None) -> None:
    """One uneven all_to_all_single of whole slot rows: to rank d the rows plan[d] asks of us,
    from rank s the rows we ask of s, both in plan order."""
    row = math.prod(old.shape[1:])  # elements per slot
    send_rows = [m.from_slot for ms in sends for m in ms]
    send = old.reshape(old.shape[0], row)[send_rows]  # [n_send, row]
    recv = old.new_empty(sum(len(ms) for ms in recvs), row)  # [n_recv, row]
    dist.all_to_all_single(recv, send, [len(ms) for ms in recvs], [len(ms) for ms in sends], group=group)
    dst = [m.slot - first_slot for ms in recvs for m in ms]
    new.view(new.shape[0], row)[dst] = recv


def all_reduce_load(load: torch.Tensor, group: dist.ProcessGroup | None = None) -> np.ndarray:
    """Sum every rank's [L, E] (or [E]) token counts: the global load EPLB rebalances on. The sum
    runs on the CPU, so pass the gloo group (DistGroup.cpu_group) when the main group is NCCL."""
    total = load.detach().to(torch.long).cpu().clone()
    dist.all_reduce(total, group=group)
    return total.numpy()
