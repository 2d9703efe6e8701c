"""A worker's share of the routed experts under expert parallelism, and keeping it balanced.

Before loading, `initial_placement` says which logical experts each rank's MoE layers hold
(E/N slots plus R/N redundant ones per rank; the model's layers, then its MTP layers — for V4.1
the backbone's only), and
`experts_to_load` turns that into `load_model(experts=...)`, so each rank reads only its share.
After loading, `ExpertParallel` wires every MoE layer to an `ExpertParallelMoE` (dispatch to the
ranks that own a token's experts, local grouped GEMMs, combine) over the group's all-to-all.

EPLB: every MoE layer counts its tokens per logical expert; `rebalance()` (called by every rank
at the same step) sums the counts over the group, computes DeepSeek's placement for them, moves
expert weights between ranks for the slots that changed, and switches every layer to the new
maps. Output does not change: every replica of an expert holds the same weights.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..config import ModelConfig, ParallelConfig
from ..models import registry
from . import eplb
from .all2all import NaiveAllGather, PaddedA2A, SlotLayout, TorchA2A
from .ep_moe import ExpertParallelMoE

logger = logging.getLogger(__name__)


def moe_layer_ids(cfg: ModelConfig, num_mtp: int) -> list[int]:
    """Placement layer index of every MoE layer: the model's, then its MTP layers'. DeepSeek-V4.1:
    the backbone's only; its DSpark stages (fewer experts each) stay whole on every rank, so
    drafting runs no collective and the placement has one expert count."""
    return registry.of(cfg).moe_layer_ids(cfg, num_mtp)


def initial_placement(cfg: ModelConfig, num_mtp: int, parallel: ParallelConfig) -> eplb.Placement:
    """Identity placement, or with redundant experts the EPLB placement of a uniform load
    (redundant replicas spread over the experts in order)."""
    layers, n = len(moe_layer_ids(cfg, num_mtp)), parallel.data_parallel_size
    r = parallel.num_redundant_experts
    if (cfg.n_routed_experts + r) % n:
        raise ValueError(f"{cfg.n_routed_experts} experts + {r} redundant do not split over {n} ranks")
    if r == 0:
        return eplb.identity_placement(layers, cfg.n_routed_experts, n)
    return eplb.rebalance(np.ones((layers, cfg.n_routed_experts)), n, r)


def experts_to_load(placement: eplb.Placement, rank: int) -> dict[int, list[int]]:
    """load_model's `experts`: layer → the logical experts of this rank's slots, in slot order."""
    return {layer: placement.local_experts(layer, rank).tolist() for layer in range(placement.num_layers)}


class ExpertParallel:
    """The expert-parallel side of one rank's model: per-layer dispatch and EPLB."""

    def __init__(self, model, group, parallel: ParallelConfig, placement: eplb.Placement,
                 max_tokens_per_step: int):
        self.model, self.group, self.parallel, self.placement = model, group, parallel, placement
        self.rank = group.rank
        layout = SlotLayout(placement.num_physical, group.world_size)
        self.a2a = _backend(resolve_all2all(parallel.all2all_backend, model.device), layout, group.group,
                            capacity=max_tokens_per_step * model.cfg.num_experts_per_tok)
        self.layers = [_moe_of(model, layer) for layer in range(placement.num_layers)]
        self.dispatchers: list[ExpertParallelMoE] = []
        for layer, moe in enumerate(self.layers):
            maps = placement.layer_maps(layer, model.device)
            ep = _dispatcher(model, self.a2a, moe, maps)
            moe.parallel = ep
            self.dispatchers.append(ep)
        self.last_imbalance: list[float] = [1.0] * placement.num_layers  # per layer, of the last window
        self.rebalances = 0
        # The load EPLB places for: every window's group load, older windows decayed by half each
        # time, so one odd window (a burst of one prompt) cannot swing the placement alone.
        self.load_history: np.ndarray | None = None  # [L, E] float64

    LOAD_DECAY = 0.5

    def rebalance(self, move_weights: bool) -> tuple[list[float], list[float]]:
        """Sum the group's expert loads since the last call; with `move_weights`, adopt the
        EPLB placement for them. Every rank calls this at the same step (collectives).
        Returns the per-layer imbalance (max / mean of per-rank expert tokens) of the window's
        load under the placement that served it and under the one in force now."""
        load = torch.stack([ep.take_load().cpu() for ep in self.dispatchers])  # [L, E]
        total = eplb.all_reduce_load(load, self.group.cpu_group)
        before = eplb.imbalance(total, self.placement)
        self.last_imbalance = before.tolist()  # observed: the window ran under the old placement
        history = total.astype(np.float64) if self.load_history is None else self.LOAD_DECAY * self.load_history + total
        self.load_history = history  # identical on every rank: built from all-reduced loads only
        if not move_weights or total.sum() == 0:
            return before.tolist(), before.tolist()
        t0 = time.perf_counter()
        new = eplb.rebalance(history, self.placement.num_ranks, self.parallel.num_redundant_experts)
        plan = eplb.migration_plan(self.placement, new)
        for layer, (moe, ep) in enumerate(zip(self.layers, self.dispatchers)):
            stored = moe.experts.state_dict()
            tensors = eplb.migrate_expert_weights({n: _on_wire(t) for n, t in stored.items()}, plan, layer,
                                                  new.slots_per_rank, self.rank, self.group.group)
            tensors = {n: t.view(stored[n].dtype) for n, t in tensors.items()}  # the same bits, stored dtype
            moe.experts.adopt(tensors, new.local_experts(layer, self.rank).tolist())
            ep.set_placement(*new.layer_maps(layer, self.model.device))
        self.placement = new
        self.rebalances += 1
        after = eplb.imbalance(total, new)  # what the same load would give under the new placement
        logger.info("EPLB: rebalanced %d layers in %.2f s; imbalance %.3f -> %.3f (mean over layers)",
                    len(self.layers), time.perf_counter() - t0, float(before.mean()), float(after.mean()))
        return before.tolist(), after.tolist()


def _on_wire(t: torch.Tensor) -> torch.Tensor:
    """FP8 codes and E8M0 scales as their bytes: gloo's all-to-all has no float8 types."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def _dispatcher(model, a2a, moe, maps) -> ExpertParallelMoE:
    return registry.of(model.cfg).expert_parallel_moe(model, a2a, moe, maps)


def _moe_of(model, layer: int):
    n = model.cfg.num_layers
    return model.layers[layer].ffn if layer < n else model.mtp[layer - n].block.ffn


def resolve_all2all(name: str, device: torch.device) -> str:
    """--all2all-backend auto: the padded all-to-all on CUDA, where decode steps are captured as
    graphs (fixed buffers, no host read), the uneven one on CPU (less data moved)."""
    if name == "auto":
        return "padded_all_to_all" if torch.device(device).type == "cuda" else "all_to_all"
    return name


def _backend(name: str, layout: SlotLayout, group, capacity: int):
    if name == "all_to_all":
        return TorchA2A(layout, group)
    if name == "padded_all_to_all":
        return PaddedA2A(layout, group, capacity=capacity)
    if name == "allgather_reducescatter":
        return NaiveAllGather(layout, group)
    raise ValueError(f"unknown --all2all-backend {name!r}")
