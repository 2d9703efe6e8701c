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

plus any int64 fields an architecture adds (`extra`, e.g. DeepSeek-V4.1's Engram hash ids),
so the step can be captured once as a CUDA graph and replayed with new contents. Every slot is
computed from these tensors on the device. Padding rows (B larger than the live batch) have
start 0 and all-zero tables: they read and write only the dummy block 0, whose contents are
never visible to a real sequence (every out-of-range read is masked and zeroed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .kv_cache import KVCache
from .v4 import attention_decode


_FIELDS = ("token_ids", "positions", "start", "full_table", "sliding_table", "sliding_first")


class HostMirrors:
    """Pinned host copies of a device buffer, each filled on the host and then copied over
    without blocking. A mirror is rewritten only once its last copy has run (its event has
    completed): with async scheduling a step is filled while the previous one is still on the
    device, and a shape may be filled several times per step (MTP catch-up and drafts). When
    every mirror is still busy a new one is added, up to `limit`; past it the fill waits for
    the oldest copy."""

    def __init__(self, numel: int, limit: int = 8, pinned=None, new_event=None):
        self.numel, self.limit = numel, limit
        self._pinned = pinned or (lambda n: torch.zeros(n, dtype=torch.long, pin_memory=True))
        self._new_event = new_event or torch.cuda.Event
        self.mirrors: list[torch.Tensor] = []
        self._events: list = []  # per mirror: the event after its last copy (None: never copied)
        self._issued: list[int] = []  # per mirror: when its last copy was issued (a counter)
        self._count = 0
        self._next = 0

    def take(self) -> int:
        """The index of a mirror the host may write now."""
        n = len(self.mirrors)
        for i in range(n):
            j = (self._next + i) % n
            if self._events[j] is None or self._events[j].query():
                self._next = (j + 1) % n
                return j
        if n < self.limit:
            self.mirrors.append(self._pinned(self.numel))
            self._events.append(None)
            self._issued.append(0)
            self._next = 0
            return n
        j = min(range(n), key=self._issued.__getitem__)
        self._events[j].synchronize()  # every mirror's copy is still queued: wait for the oldest
        self._next = (j + 1) % n
        return j

    def copied(self, index: int) -> None:
        """Mark mirror `index`'s copy as issued (on the current stream)."""
        event = self._new_event()
        event.record()
        self._events[index] = event
        self._count += 1
        self._issued[index] = self._count


@dataclass
class DecodeBatch:
    """Every field is a view of one int64 device buffer (`_device`), filled from a host mirror
    by a single copy per step. On CUDA the mirrors are pinned (`HostMirrors`), so a fill never
    rewrites memory whose copy the device may not have run yet; on CPU the mirror is the buffer."""

    cache: KVCache
    tokens_per_seq: int  # q
    token_ids: torch.Tensor  # [B·q] int64
    positions: torch.Tensor  # [B·q] int64
    start: torch.Tensor  # [B] int64
    full_table: torch.Tensor  # [B, F] int64
    sliding_table: torch.Tensor  # [B, S] int64
    sliding_first: torch.Tensor  # [B] int64
    _device: torch.Tensor
    _mirrors: HostMirrors | None  # CUDA: the pinned mirrors; None on CPU (the buffer is its own mirror)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # an architecture's own int64 fields
    _host_parts: dict[int, dict[str, np.ndarray]] = field(init=False, default_factory=dict)  # per mirror

    def _field(self, name: str) -> torch.Tensor:
        return self.extra[name] if name in self.extra else getattr(self, name)

    def _parts(self, host: torch.Tensor, key: int) -> dict[str, np.ndarray]:
        """numpy views of a mirror, per field."""
        parts = self._host_parts.get(key)
        if parts is None:
            names = _FIELDS + tuple(self.extra)
            sizes = [self._field(name).numel() for name in names]
            parts = self._host_parts[key] = {name: part.reshape(self._field(name).shape) for name, part
                                             in zip(names, np.split(host.numpy(), np.cumsum(sizes)[:-1]))}
        return parts

    @classmethod
    def allocate(cls, cache: KVCache, num_seqs: int, tokens_per_seq: int, full_blocks: int,
                 sliding_blocks: int, extra: dict[str, tuple[int, ...]] | None = None) -> "DecodeBatch":
        """Zeroed buffers (all rows padding) for a batch shape; `extra`: name → shape of more
        int64 fields, after the standard ones in the same buffer (filled by the same copy)."""
        n = num_seqs * tokens_per_seq
        shapes = ((n,), (n,), (num_seqs,), (num_seqs, full_blocks), (num_seqs, sliding_blocks), (num_seqs,))
        shapes += tuple((extra or {}).values())
        sizes = [math.prod(shape) for shape in shapes]
        device = torch.zeros(sum(sizes), dtype=torch.long, device=cache.device)
        mirrors = HostMirrors(sum(sizes)) if device.device.type == "cuda" else None
        views = [part.view(shape) for part, shape in zip(device.split(sizes), shapes)]
        return cls(cache, tokens_per_seq, *views[: len(_FIELDS)], _device=device, _mirrors=mirrors,
                   extra=dict(zip(extra or {}, views[len(_FIELDS):])))

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

    def attend(self, attn, layer: int, q, kv, x, q_res, rope, comp_rows, idx_rows, rope_table) -> torch.Tensor:
        """The attention context interface (see engine/v4/attention.py): [T, H, hd] fp32."""
        return attention_decode.attend(attn, layer, q, kv, x, q_res, rope, comp_rows, idx_rows, rope_table, self)

    # ---- filling (host side, outside any graph) -------------------------------------------------
    def fill(self, rows: list[tuple[list[int], int, list[int], list[int], int]],
             extra: dict[str, np.ndarray] | None = None) -> None:
        """Copy a live batch into the buffers; rows past len(rows) become padding.

        rows: per sequence (token ids [q], start, full block ids ≤ F, sliding block ids ≤ S,
        sliding_first); extra: values of `extra` fields (a leading part of each; the rest is 0).
        Written into a host mirror as numpy arrays, then one copy (none on CPU).
        """
        q, n = self.tokens_per_seq, len(rows)
        if self._mirrors is None:
            index, host = -1, self._device
        else:
            index = self._mirrors.take()
            host = self._mirrors.mirrors[index]
        parts = self._parts(host, index)
        host.zero_()
        tokens, start, first = parts["token_ids"], parts["start"], parts["sliding_first"]
        full, sliding = parts["full_table"], parts["sliding_table"]
        tokens[: n * q] = [t for r in rows for t in r[0]]
        start[:n] = [r[1] for r in rows]
        first[:n] = [r[4] for r in rows]
        for i, (_, _, full_ids, sliding_ids, _) in enumerate(rows):
            full[i, : len(full_ids)] = full_ids
            sliding[i, : len(sliding_ids)] = sliding_ids
        parts["positions"][:] = (start[:, None] + np.arange(q)).reshape(-1)  # padding rows: 0..q-1
        for name, values in (extra or {}).items():
            parts[name][: len(values)] = values
        if self._mirrors is not None:
            self._device.copy_(host, non_blocking=True)
            self._mirrors.copied(index)
