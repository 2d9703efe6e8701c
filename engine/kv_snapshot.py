"""Snapshots of a sequence's sliding state at a block boundary, so that a prefix-cache hit can
resume there exactly instead of recomputing the window.

What computing from a block boundary H reads of the sliding pools (block sizes are multiples of
every compress ratio, so H is a compress boundary too):
  * a window pool (`swa`): the `window − 1` rows before H, every layer (MTP layers, or V4.1's
    DSpark stage windows, included);
  * a compressor-state pool (`state_*`, rows [C | Z + ape]): the overlapping compressor's next
    entry pools the `span − m` rows before H (the previous window's Ca half, m for CSA); a plain
    compressor's (HCA, span = m) reads none.
A snapshot keeps exactly those rows, as the pools store them (raw records, no re-quantization),
so restoring it into a fresh sequence's sliding blocks gives the same bytes the cold run had.
Everything is read from the layout (`KVLayout`), so layouts other than V4's work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_layout import KVLayout, PoolSpec


def compress_ratio_of(layout: KVLayout, spec: PoolSpec) -> int | None:
    """The compress ratio m of the full pool a compressor-state pool feeds (the full pool its
    writer layers also write, with m tokens per record); None for window pools."""
    if not spec.name.startswith("state_"):
        return None
    ratios = [p.tokens_per_record for p in layout.pools
              if p.group == "full" and p.tokens_per_record > 1 and set(spec.layers) <= set(p.layers)]
    return min(ratios) if ratios else None


def boundary_rows(layout: KVLayout) -> dict[str, int]:
    """Per sliding pool: rows before a block boundary that computing from it reads."""
    rows = {}
    for spec in layout.pools:
        if spec.group != "sliding":
            continue
        m = compress_ratio_of(layout, spec)
        if spec.name.startswith("state_"):
            rows[spec.name] = max(0, spec.window - m) if m is not None else spec.window  # unknown: all of it
        else:
            rows[spec.name] = max(0, spec.window - 1)
    return rows


def snapshot_bytes(layout: KVLayout) -> int:
    """Bytes one snapshot holds: Σ over sliding pools of rows × record bytes × layers."""
    rows = boundary_rows(layout)
    return sum(rows[p.name] * p.record_bytes * len(p.layers) for p in layout.pools if p.name in rows)


@dataclass
class SlidingState:
    """A snapshot outside the store (what a prefill worker hands a decode worker): per pool and
    writer layer the raw records of positions [end − rows, end), `rows` = min(pool rows, end)."""

    end: int
    rows: dict[str, dict[int, torch.Tensor]]  # pool → layer → [rows, *record shape]


class SnapshotStore:
    """`num_slots` preallocated snapshots; slot bookkeeping (which key, LRU) is the caller's."""

    def __init__(self, cache, num_slots: int):
        self.cache, self.num_slots = cache, num_slots
        self.rows = boundary_rows(cache.layout)
        self.buffers: dict[str, dict[int, torch.Tensor]] = {}
        for name, n in self.rows.items():
            pool = cache.pools[name]
            self.buffers[name] = {layer: torch.zeros((num_slots, n, *t.shape[2:]), dtype=t.dtype, device=t.device)
                                  for layer, t in pool.tensors.items()}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for per in self.buffers.values() for b in per.values())

    @staticmethod
    def _slots(seq, end: int, n: int) -> torch.Tensor:
        return seq.sliding_slots(max(0, end - n), end)  # [min(n, end)] flat slot ids

    def save(self, slot: int, seq, end: int) -> None:
        """Copy `seq`'s rows before position `end` into `slot` (they must still be readable)."""
        for name, per in self.buffers.items():
            n = self.rows[name]
            idx = self._slots(seq, end, n)
            for layer, buf in per.items():
                t = self.cache.pools[name].tensors[layer]
                buf[slot, : idx.numel()] = t.view(-1, *t.shape[2:])[idx]

    def restore(self, slot: int, seq, end: int) -> None:
        """Write `slot` back as `seq`'s rows before `end` (its sliding blocks must cover them)."""
        for name, per in self.buffers.items():
            n = self.rows[name]
            idx = self._slots(seq, end, n)
            for layer, buf in per.items():
                t = self.cache.pools[name].tensors[layer]
                t.view(-1, *t.shape[2:])[idx] = buf[slot, : idx.numel()]


# ---- outside the store (prefill → decode hand-off) --------------------------------------------
def export_state(cache, seq, end: int) -> SlidingState:
    """`seq`'s rows before `end` of every sliding pool, copied out (raw records)."""
    rows = boundary_rows(cache.layout)
    out: dict[str, dict[int, torch.Tensor]] = {}
    for name, n in rows.items():
        idx = seq.sliding_slots(max(0, end - n), end)
        out[name] = {layer: t.view(-1, *t.shape[2:])[idx].clone() for layer, t in cache.pools[name].tensors.items()}
    return SlidingState(end, out)


def import_state(cache, seq, state: SlidingState) -> None:
    """Write a `SlidingState` into `seq`'s sliding blocks (they must cover [end − rows, end))."""
    rows = boundary_rows(cache.layout)
    for name, n in rows.items():
        idx = seq.sliding_slots(max(0, state.end - n), state.end)
        for layer, t in cache.pools[name].tensors.items():
            src = state.rows[name][layer]
            if src.shape[0] != idx.numel():
                raise ValueError(f"state of pool {name} holds {src.shape[0]} rows, {idx.numel()} expected")
            t.view(-1, *t.shape[2:])[idx] = src.to(t.device)
