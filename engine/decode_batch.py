"""A decode or verify step in static shapes: B sequences × q tokens each, over the paged pools.

The per-sequence path (`SeqSlice` lists) handles any mix of prefill chunks and decodes, but its
shapes and Python loops change every step. A step in which every sequence computes the same
number q of trailing tokens (decode: q = 1; verify: q = 1 + drafts) can instead be described by
a few tensors whose shapes depend only on (B, q, table widths):

    token_ids, positions   [B·q]   sequence b owns rows [b·q, (b+1)·q), positions start[b] + j
    start                  [B]
    full_table             [B, F]  logical block → id in the `full` pools; 0 (dummy) beyond
    sliding_table          [B, S]  logical block sliding_first[b] + i → id in the `sliding` pools
    sliding_first          [B]

so the step can be captured once as a CUDA graph and replayed with new contents. Every slot is
computed from these tensors on the device. Padding rows (B larger than the live batch) have
start 0 and all-zero tables: they read and write only the dummy block 0, whose contents are
never visible to a real sequence (every out-of-range read is masked and zeroed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kv_cache import KVCache


@dataclass
class DecodeBatch:
    cache: KVCache
    tokens_per_seq: int  # q
    token_ids: torch.Tensor  # [B·q] int64
    positions: torch.Tensor  # [B·q] int64
    start: torch.Tensor  # [B] int64
    full_table: torch.Tensor  # [B, F] int64
    sliding_table: torch.Tensor  # [B, S] int64
    sliding_first: torch.Tensor  # [B] int64

    @classmethod
    def allocate(cls, cache: KVCache, num_seqs: int, tokens_per_seq: int, full_blocks: int,
                 sliding_blocks: int) -> "DecodeBatch":
        """Zeroed buffers (all rows padding) for a batch shape."""
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.long, device=cache.device)

        n = num_seqs * tokens_per_seq
        return cls(cache, tokens_per_seq, zeros(n), zeros(n), zeros(num_seqs), zeros(num_seqs, full_blocks),
                   zeros(num_seqs, sliding_blocks), zeros(num_seqs))

    @property
    def num_seqs(self) -> int:
        return self.start.shape[0]

    @property
    def max_context(self) -> int:
        """Positions the full table can address: the largest start + q this shape serves."""
        return self.full_table.shape[1] * self.cache.layout.block_size

    def sliding_slots(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, L] → (slots [B, L], valid [B, L]) in the sliding pools. Negative positions and
        positions outside the table are invalid and map to slot 0 (the dummy block)."""
        b = self.cache.layout.block_size
        logical = torch.div(pos, b, rounding_mode="floor") - self.sliding_first[:, None]
        valid = (pos >= 0) & (logical >= 0) & (logical < self.sliding_table.shape[1])
        ids = self.sliding_table.gather(1, logical.clamp(0, self.sliding_table.shape[1] - 1))
        slots = ids * b + pos.remainder(b)
        return torch.where(valid, slots, torch.zeros_like(slots)), valid

    def entry_slots(self, entry: torch.Tensor, tokens_per_record: int) -> torch.Tensor:
        """entry [B, E] indices (0 ≤ entry < max_context / m) → slots [B, E] in a full pool of
        records covering `tokens_per_record` positions each."""
        per_block = self.cache.layout.block_size // tokens_per_record
        ids = self.full_table.gather(1, torch.div(entry, per_block, rounding_mode="floor"))
        return ids * per_block + entry.remainder(per_block)

    # ---- filling (host side, outside any graph) -------------------------------------------------
    def fill(self, rows: list[tuple[list[int], int, list[int], list[int], int]]) -> None:
        """Copy a live batch into the buffers; rows past len(rows) become padding.

        rows: per sequence (token ids [q], start, full block ids ≤ F, sliding block ids ≤ S,
        sliding_first). Built in host arrays first: one copy per buffer, no per-row tensors.
        """
        q, nseq = self.tokens_per_seq, self.num_seqs
        tokens = np.zeros(nseq * q, dtype=np.int64)
        start = np.zeros(nseq, dtype=np.int64)
        first = np.zeros(nseq, dtype=np.int64)
        full = np.zeros(tuple(self.full_table.shape), dtype=np.int64)
        sliding = np.zeros(tuple(self.sliding_table.shape), dtype=np.int64)
        n = len(rows)
        tokens[: n * q] = [t for r in rows for t in r[0]]
        start[:n] = [r[1] for r in rows]
        first[:n] = [r[4] for r in rows]
        for i, (_, _, full_ids, sliding_ids, _) in enumerate(rows):
            full[i, : len(full_ids)] = full_ids
            sliding[i, : len(sliding_ids)] = sliding_ids
        positions = (start[:, None] + np.arange(q)).reshape(-1)  # padding rows: 0..q-1
        for dst, src in ((self.token_ids, tokens), (self.positions, positions), (self.start, start),
                         (self.full_table, full), (self.sliding_table, sliding), (self.sliding_first, first)):
            dst.copy_(torch.from_numpy(src), non_blocking=True)
