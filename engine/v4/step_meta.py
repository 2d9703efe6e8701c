"""Slot tables of one static-shape decode step, built once and shared by every layer.

Which window slots each query reads, where this step's keys and compressor rows go, which entry
a token completes, which entries a query may see: all depend only on the batch (positions and
block tables), the window, the compression ratio and the span, never on the layer. The fused
decode path (engine/v4/fused_decode.py) builds them once per step from the `DecodeBatch` with a
handful of device ops (inside a captured graph, so a replay refreshes them), instead of every
layer rebuilding them. A slot of −1 means "nothing there": masked on read, skipped on write.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..decode_batch import DecodeBatch


@dataclass
class StepMeta:
    """B sequences × q tokens; W the sliding window."""

    positions: torch.Tensor  # [B, q] int32
    window_writes: torch.Tensor  # [T] int64: window slots of this step's tokens (padding: the dummy block)
    # Shared tables (kernels/triton/sparse_mla_decode.py): a column holds one slot for every row
    # of a sequence, or −1 where that row does not see it.
    window_slots: torch.Tensor  # [B, q, W−1] int32: positions start−W+1 .. start−1 inside each query's window
    full_table: torch.Tensor  # [B, F] int32
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # span → [B, span−1+q] compressor-state slots
    completes: dict[int, torch.Tensor] = field(default_factory=dict)  # m → [B, q] entry slot a token completes, or −1
    entry_rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # m → cos/sin [B, q, r/2]
    counts: dict[int, torch.Tensor] = field(default_factory=dict)  # m → [B] entries after the step
    visible: dict[int, torch.Tensor] = field(default_factory=dict)  # m → [B, q, E] every visible entry's slot

    @classmethod
    def build(cls, batch: DecodeBatch, cfg, rope_table, ratios: dict[int, set[int]]) -> "StepMeta":
        """`ratios`: compression ratio → the compressor spans used with it (m for HCA, 2m for CSA)."""
        b, q = batch.num_seqs, batch.tokens_per_seq
        pos = batch.positions.view(b, q)
        window = cfg.sliding_window
        hist = batch.start[:, None] - (window - 1) + torch.arange(window - 1, device=pos.device)  # [B, W−1]
        slots, valid = batch.sliding_slots(hist)
        # Every history position precedes the step, so it is in a query's window iff > p − W.
        in_window = valid[:, None, :] & (hist[:, None, :] > pos[..., None] - window)
        writes, _ = batch.sliding_slots(pos)  # padding rows: the dummy block
        meta = cls(pos.int(), writes.reshape(-1), torch.where(in_window, slots[:, None, :], -1).int(),
                   batch.full_table.int())
        for m, spans in sorted(ratios.items()):
            for span in spans:
                rpos = batch.start[:, None] - (span - 1) + torch.arange(span - 1 + q, device=pos.device)
                rslots, rvalid = batch.sliding_slots(rpos)
                meta.rows[span] = torch.where(rvalid, rslots, -1).int()
            entry = torch.div(pos, m, rounding_mode="floor")
            meta.completes[m] = torch.where((pos + 1) % m == 0, batch.entry_slots(entry, m), -1).int()
            cos, sin = rope_table((entry * m).flatten())
            meta.entry_rope[m] = (cos.view(b, q, -1), sin.view(b, q, -1))
            meta.counts[m] = torch.div(batch.start + q, m, rounding_mode="floor").int()
            index = torch.arange(batch.max_context // m, device=pos.device)
            seen = index < torch.div(pos + 1, m, rounding_mode="floor")[..., None]  # [B, q, E]
            meta.visible[m] = torch.where(seen, batch.entry_slots(index.expand(b, -1), m)[:, None, :], -1).int()
        return meta


def compressor_spans(cfg, layers: range) -> dict[int, set[int]]:
    """ratio → spans over `layers` (CSA overlaps two windows: span 2m; HCA: m)."""
    out: dict[int, set[int]] = {}
    for i in layers:
        m = cfg.compress_ratios[i]
        if m:
            out.setdefault(m, set()).add(2 * m if cfg.layer_kinds[i] == "csa" else m)
    return out
