"""Lockstep across the ranks of an expert-parallel group: one agreement per engine step.

Every MoE layer of every forward runs collectives, so every rank must run the same forwards in
the same order. Before each step, each rank says what it would do (`StepPlan`), and one small
all-reduce on the group's gloo (CPU) group gives the step that every rank then runs:

  * if any rank has work, every rank steps; a rank with none runs a dummy batch (zero tokens
    through the same collectives);
  * the number of drafts to propose is the largest any rank wants (each step's MTP forwards
    are the same count on every rank);
  * the static-shape (CUDA-graph) path only when every rank can take it (its padded all-to-all
    is not the eager path's);
  * when one rank stops, all stop.

When no rank has work, every rank parks: it tells the engine client (`Parked` with the number
of the idle agreement, the same on every rank) and sleeps until a request or a `Wake` arrives,
costing no CPU. The engine client, which sees every request first, wakes the whole group at once
(`Wake` to every rank) when it submits to a group with a parked rank, and when a rank reports
`Parked` while the group has requests in flight — the case of a request that raced the group
going idle. A `Wake` that arrives before its rank parks at that agreement is remembered, so no
wake is lost and every rank joins the next agreement. A rank with a KV connector (PD) polls its
park every connector interval instead, to tick its transfers. A rank that died or stopped
answering makes the agreement (or any collective) fail on every other rank within the group's
collective timeout, and each exits non-zero: a group cannot heal; the server restarts it under
a new generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ParallelConfig
from .group import DistGroup, init_group

IDLE_PARK_S = 1.0  # a parked rank with a KV connector ticks it this often (at most)


@dataclass(frozen=True, slots=True)
class StepPlan:
    has_work: bool
    num_drafts: int = 0
    static_ok: bool = False
    stopping: bool = False


class Lockstep:
    """One rank's side of the agreement; also runs the group's periodic EPLB window."""

    def __init__(self, group: DistGroup, ep=None, parallel: ParallelConfig | None = None):
        self.group = group
        self.rank, self.world_size = group.rank, group.world_size
        self.ep = ep  # engine.distributed.expert_parallel.ExpertParallel, or None
        self.parallel = parallel
        self._buf = torch.zeros(4, dtype=torch.int64)
        self.agreements = 0  # agreements made so far: identical on every rank (the park epoch)

    def after_step(self, steps: int) -> None:
        """Every eplb_step_interval agreed steps (the same on every rank): the group's expert
        load, and with --enable-eplb a rebalance."""
        if self.ep is not None and self.parallel is not None and steps % self.parallel.eplb_step_interval == 0:
            self.ep.rebalance(move_weights=self.parallel.enable_eplb)

    def agree(self, plan: StepPlan) -> StepPlan:
        """The step every rank runs (blocks until every rank has asked)."""
        b = self._buf
        b[0], b[1], b[2], b[3] = int(plan.has_work), plan.num_drafts, int(not plan.static_ok), int(plan.stopping)
        dist.all_reduce(b, op=dist.ReduceOp.MAX, group=self.group.cpu_group)
        self.agreements += 1
        return StepPlan(bool(b[0]), int(b[1]), not bool(b[2]), bool(b[3]))


def join_group(rank: int, parallel: ParallelConfig, master_port: int, generation: str) -> DistGroup:
    """Form the expert-parallel group of this start (NCCL on GPU, gloo on CPU)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return init_group(rank, parallel.data_parallel_size, parallel.data_parallel_address, master_port, backend,
                      generation, parallel.rendezvous_timeout_s, local_rank=0,
                      collective_timeout_s=parallel.collective_timeout_s)
