"""MoE dispatch/combine across expert-parallel ranks behind one small interface.

Each rank holds `slots_per_rank` consecutive PHYSICAL expert slots (rank r owns slots
[r·L, (r+1)·L), L = slots_per_rank; EPLB decides which logical expert sits in each slot).
A step on every rank:

    d = a2a.dispatch(x [T, H], slots [T, k], weights [T, k])   # rows this rank must compute
    y = local_experts(d.x [S, H], d.counts [L])                 # grouped by local expert
    out = a2a.combine(y [S, H], d)                              # [T, H] = Σ_j w[t, j]·y(t, j)

`d.x` holds the received (token, choice) rows grouped by local expert in ascending order, each
group in (source rank, source token, choice) order, with `d.counts[e]` rows for local expert e;
rows from `d.counts.sum()` on are padding (PaddedA2A only) whose results are ignored.
`combine` returns every result to its source rank, puts it back in (token, choice) order,
multiplies by the weight in y's dtype and sums the k choices in choice order with the same ops as
engine/v4/moe.py, so the output is bitwise that of the single-rank MoE wherever the expert arithmetic
is bitwise the same.

Backends (all are collectives: every rank calls dispatch and combine once per MoE layer per step,
in the same order, also with T = 0):
- TorchA2A: uneven all_to_all_single; per-slot counts are exchanged first (a host sync for the
  split sizes). gloo and NCCL.
- PaddedA2A: fixed [N·C, H] buffers (C rows per rank pair) and equal splits, a count table
  gathered first; static shapes and no host sync apart from the capacity check (a device assert
  under CUDA-graph capture), for graph capture. Overflow raises on every rank, never truncates.
- NaiveAllGather: the reference path; all_gather the tokens, each rank computes its experts'
  choices of every token, reduce_scatter of the per-choice results (kept per choice so the sum
  over choices is the same fixed-order sum: each entry has one nonzero contributor, so the
  reduction is exact).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# all_gather_into_tensor/reduce_scatter_tensor were renamed *_single in torch 2.13.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CapacityOverflow(RuntimeError):
    """More rows for one (source, destination) rank pair than PaddedA2A's capacity."""


@dataclass(frozen=True)
class SlotLayout:
    """num_slots physical expert slots in equal consecutive blocks over num_ranks ranks."""

    num_slots: int
    num_ranks: int

    def __post_init__(self):
        if self.num_slots <= 0 or self.num_ranks <= 0 or self.num_slots % self.num_ranks:
            raise ValueError(f"{self.num_slots} slots do not split evenly over {self.num_ranks} ranks")

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def owner(self, slot: int) -> int:
        return slot // self.slots_per_rank


@dataclass
class Dispatched:
    """What the local rank computes: x [S, H] grouped by local expert, counts [L] int64 rows per
    local expert (counts.sum() <= S; rows after it are padding), and the backend's state for combine."""

    x: torch.Tensor
    counts: torch.Tensor
    state: object = field(repr=False)


@dataclass
class A2AStats:
    """Bytes this rank put on the wire for other ranks (rows to itself are local copies)."""

    calls: int = 0
    header_bytes: int = 0
    dispatch_bytes: int = 0
    combine_bytes: int = 0

    def reset(self) -> None:
        self.calls = self.header_bytes = self.dispatch_bytes = self.combine_bytes = 0


def weighted_sum(y_tk: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y_tk [T·k, H] in (token, choice) order, weights [T, k] -> [T, H]: the weight is applied in
    y's dtype and the k choices are summed along one dim, exactly as engine/v4/moe.py does."""
    t, k = weights.shape
    y = y_tk * weights.reshape(-1, 1).to(y_tk.dtype)  # [T·k, H]
    return y.view(t, k, y_tk.shape[1]).sum(dim=1).to(out_dtype)  # [T, H]


def sort_by_slot(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """slots [T, k] -> flat [T·k] int64 (slot of flat choice t·k+j), order [T·k] (flat choices
    sorted by slot, stable: ascending (token, choice) within a slot), per_slot [P] int64 counts.
    Slots are grouped per owner rank, so `order` is destination-rank major, local-expert minor.
    No host sync (index_add_, not bincount, whose CUDA version reads the max back)."""
    flat = slots.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    per_slot = torch.zeros(num_slots, dtype=torch.long, device=slots.device)
    per_slot.index_add_(0, flat, torch.ones_like(flat))
    return flat, order, per_slot


def _check_slots(slots: torch.Tensor, num_slots: int) -> None:
    if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < num_slots):
        lo, hi = int(slots.min()), int(slots.max())
        raise ValueError(f"physical slot ids must lie in [0, {num_slots}), got [{lo}, {hi}]")


def _exclusive_cumsum(v: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(v, 0) - v


class All2All(ABC):
    """dispatch/combine over `group` (None: the default group) for the slot layout."""

    def __init__(self, layout: SlotLayout, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if layout.num_ranks != self.world_size:
            raise ValueError(f"layout is for {layout.num_ranks} ranks, the group has {self.world_size}")
        self.layout = layout
        self.stats = A2AStats()

    @abstractmethod
    def dispatch(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        """x [T, H], slots [T, k] physical slot ids, weights [T, k] fp32 -> rows for the local experts."""

    @abstractmethod
    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """y [S, H] (results for d.x, same order) -> out [T, H] on the rank that dispatched."""

    def _remote_bytes(self, rows_per_rank: list[int], row_bytes: int) -> int:
        return sum(n for r, n in enumerate(rows_per_rank) if r != self.rank) * row_bytes


@dataclass
class _TorchState:
    order: torch.Tensor  # [T·k] flat choices sorted by destination rank then local expert
    regroup: torch.Tensor  # [S] received (source-major) row feeding each expert-major row
    send_splits: list[int]  # [N] rows sent to each rank
    recv_splits: list[int]  # [N] rows received from each rank
    weights: torch.Tensor  # [T, k]
    out_dtype: torch.dtype


class TorchA2A(All2All):
    """Uneven all_to_all_single: exactly the routed rows travel (gloo or NCCL)."""

    def dispatch(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        n, l = self.world_size, self.layout.slots_per_rank
        k, h = slots.shape[1], x.shape[1]
        _check_slots(slots, self.layout.num_slots)
        flat, order, per_slot = sort_by_slot(slots, self.layout.num_slots)
        send_counts = per_slot.view(n, l)  # [N(dst), L]
        recv_counts = torch.empty_like(send_counts)  # [N(src), L]
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # split sizes first
        send_splits = send_counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        send_x = x[order // k]  # [T·k, H] destination-rank major
        recv_x = x.new_empty(sum(recv_splits), h)  # [S, H] source-rank major
        dist.all_to_all_single(recv_x, send_x, recv_splits, send_splits, group=self.group)
        experts = torch.arange(l, device=x.device).repeat(n)  # [N·L] local expert of each count
        local = torch.repeat_interleave(experts, recv_counts.reshape(-1))  # [S]
        regroup = torch.sort(local, stable=True).indices  # [S] source-major -> expert-major
        self.stats.calls += 1
        self.stats.header_bytes += (n - 1) * l * 8
        self.stats.dispatch_bytes += self._remote_bytes(send_splits, h * x.element_size())
        state = _TorchState(order, regroup, send_splits, recv_splits, weights, x.dtype)
        return Dispatched(recv_x[regroup], recv_counts.sum(0), state)

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        s: _TorchState = d.state
        h = y.shape[1]
        src_major = torch.empty_like(y)
        src_major[s.regroup] = y  # [S, H] back to the order it arrived in
        back = y.new_empty(s.order.numel(), h)  # [T·k, H] destination-rank major
        dist.all_to_all_single(back, src_major, s.send_splits, s.recv_splits, group=self.group)
        y_tk = torch.empty_like(back)
        y_tk[s.order] = back  # [T·k, H] (token, choice) order
        self.stats.combine_bytes += self._remote_bytes(s.recv_splits, h * y.element_size())
        return weighted_sum(y_tk, s.weights, s.out_dtype)


@dataclass
class _PaddedState:
    order: torch.Tensor  # [T·k] flat choices sorted by destination rank then local expert
    buffer_rows: torch.Tensor  # [T·k] row of order[i] in the padded [N·C, H] send buffer
    regroup: torch.Tensor  # [N·C] received buffer row feeding each expert-major row
    weights: torch.Tensor  # [T, k]
    out_dtype: torch.dtype


class PaddedA2A(All2All):
    """Fixed-size buffers of `capacity` rows per rank pair: equal splits, static shapes.

    Header: an all_gather of every rank's [N, L] per-destination, per-local-expert counts, so all
    ranks see the same [N, N] rows-per-pair table and all raise CapacityOverflow together (no rank
    is left waiting in the data exchange). d.x has N·C rows: valid rows first, zeros after."""

    def __init__(self, layout: SlotLayout, group: dist.ProcessGroup | None = None, *, capacity: int):
        super().__init__(layout, group)
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity

    def dispatch(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        n, l, c = self.world_size, self.layout.slots_per_rank, self.capacity
        k, h = slots.shape[1], x.shape[1]
        flat, order, per_slot = sort_by_slot(slots, self.layout.num_slots)
        counts = per_slot.view(n, l)  # [N(dst), L]
        table = counts.new_empty(n * n * l)
        _all_gather(table, counts.reshape(-1), group=self.group)
        table = table.view(n, n, l)  # [N(src), N(dst), L]
        self._check_capacity(table.sum(-1))
        dest = flat[order] // l  # [T·k] ascending
        pos = torch.arange(order.numel(), device=x.device) - _exclusive_cumsum(counts.sum(1))[dest]
        buffer_rows = dest * c + pos  # [T·k]
        send = x.new_zeros(n * c, h)  # [N·C, H]
        send[buffer_rows] = x[order // k]
        recv = torch.empty_like(send)  # [N·C, H] block per source rank
        dist.all_to_all_single(recv, send, group=self.group)
        recv_counts = table[:, self.rank, :]  # [N(src), L]
        rows = torch.arange(c, device=x.device).expand(n, c).contiguous()  # [N, C]
        local = torch.searchsorted(recv_counts.cumsum(1), rows, right=True)  # [N, C]; L = padding
        regroup = torch.sort(local.reshape(-1), stable=True).indices  # [N·C] padding sorts last
        self.stats.calls += 1
        self.stats.header_bytes += (n - 1) * n * l * 8
        self.stats.dispatch_bytes += (n - 1) * c * h * x.element_size()
        state = _PaddedState(order, buffer_rows, regroup, weights, x.dtype)
        return Dispatched(recv[regroup], recv_counts.sum(0), state)

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        s: _PaddedState = d.state
        n, c = self.world_size, self.capacity
        if y.shape[0] != n * c:
            raise ValueError(f"PaddedA2A.combine wants [{n * c}, H] results (padding included), got {tuple(y.shape)}")
        src_major = torch.empty_like(y)
        src_major[s.regroup] = y  # [N·C, H] block per source rank
        back = torch.empty_like(src_major)  # [N·C, H] block per destination rank
        dist.all_to_all_single(back, src_major, group=self.group)
        y_tk = back.new_empty(s.order.numel(), y.shape[1])
        y_tk[s.order] = back[s.buffer_rows]  # [T·k, H] (token, choice) order
        self.stats.combine_bytes += (n - 1) * c * y.shape[1] * y.element_size()
        return weighted_sum(y_tk, s.weights, s.out_dtype)

    def _check_capacity(self, pair_rows: torch.Tensor) -> None:
        """pair_rows [N(src), N(dst)]: identical on every rank, so every rank decides the same.
        On CUDA a device-side trap, in and out of graph capture (a host check would sync every
        MoE layer of every eager step; the capacity, max tokens per step × top-k, cannot be
        exceeded by a correct caller, so the trap only ever catches a bug)."""
        if pair_rows.is_cuda:
            torch._assert_async(pair_rows.max() <= self.capacity)  # never silent
            return
        worst = int(pair_rows.max())
        if worst > self.capacity:
            src, dst = divmod(int(pair_rows.argmax()), self.world_size)
            raise CapacityOverflow(f"{worst} rows from rank {src} to rank {dst} exceed the capacity of "
                                   f"{self.capacity} rows per rank pair")


@dataclass
class _NaiveState:
    picked: torch.Tensor  # [S] flat (source rank, token, choice) positions this rank computed
    tokens: int  # T on this rank
    max_tokens: int  # max T over the ranks (the all_gather chunk)
    weights: torch.Tensor  # [T, k]
    out_dtype: torch.dtype


class NaiveAllGather(All2All):
    """Reference path: every rank sees every token and computes the choices routed to its slots."""

    def dispatch(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        n, l = self.world_size, self.layout.slots_per_rank
        (t, k), h = slots.shape, x.shape[1]
        _check_slots(slots, self.layout.num_slots)
        sizes = torch.empty(n, dtype=torch.long, device=x.device)
        _all_gather(sizes, torch.tensor([t], device=x.device), group=self.group)
        tmax = int(sizes.max())
        xs = x.new_empty(n * tmax, h)  # [N·Tmax, H] every rank's tokens, zero padded
        _all_gather(xs, torch.cat([x, x.new_zeros(tmax - t, h)]), group=self.group)
        padded = torch.cat([slots.long(), slots.new_full((tmax - t, k), -1, dtype=torch.long)])
        all_slots = padded.new_empty(n * tmax, k)  # [N·Tmax, k]; -1 = padding token
        _all_gather(all_slots, padded, group=self.group)
        flat = all_slots.reshape(-1)  # [N·Tmax·k]
        lo = self.rank * l
        mine = ((flat >= lo) & (flat < lo + l)).nonzero().squeeze(1)  # [S] choices on my slots
        local = flat[mine] - lo
        picked = mine[torch.sort(local, stable=True).indices]  # [S] grouped by local expert
        counts = torch.zeros(l, dtype=torch.long, device=x.device).index_add_(0, local, torch.ones_like(local))
        self.stats.calls += 1
        self.stats.header_bytes += (n - 1) * 8
        self.stats.dispatch_bytes += (n - 1) * tmax * (h * x.element_size() + k * 8)
        return Dispatched(xs[picked // k], counts, _NaiveState(picked, t, tmax, weights, x.dtype))

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        s: _NaiveState = d.state
        n, h = self.world_size, y.shape[1]
        k = s.weights.shape[1]
        full = y.new_zeros(n * s.max_tokens * k, h)  # [N·Tmax·k, H] one nonzero rank per row
        full[s.picked] = y
        mine = y.new_empty(s.max_tokens * k, h)  # [Tmax·k, H] this rank's tokens
        _reduce_scatter(mine, full, group=self.group)
        self.stats.combine_bytes += (n - 1) * s.max_tokens * k * h * y.element_size()
        return weighted_sum(mine[: s.tokens * k], s.weights, s.out_dtype)
