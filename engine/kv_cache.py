"""Preallocated paged KV pools shared by every sequence, and per-sequence views onto them.

`PagedSequence` offers the same position-indexed interface as the dense `SequenceState`
(`window`, `compressor.rows`, `compressor.entries`, `indexer.*` with `read`/`write`), so the
attention maths is unchanged; slots come from the sequence's block table and records are
quantized on write and dequantized on read by the `kernels` ops (raw dtypes are indexed
directly).
"""

from __future__ import annotations

import torch

import kernels

from .block_manager import BlockManager, BlockTable
from .config import ModelConfig
from .kv_layout import RAW_FORMATS, KVLayout, PoolSpec, build_layout
from .kv_snapshot import SnapshotStore, snapshot_bytes

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Pool:
    """One pool spec's storage: a tensor per writer layer, [num_blocks, records per block, …]."""

    def __init__(self, spec: PoolSpec, num_blocks: int, block_size: int, device: torch.device | str):
        self.spec = spec
        self.records_per_block = block_size // spec.tokens_per_record
        if spec.fmt in RAW_FORMATS:
            shape = (num_blocks, self.records_per_block, spec.width)
            dtype = _TORCH_DTYPES[spec.fmt]
        else:
            shape = (num_blocks, self.records_per_block, spec.record_bytes)
            dtype = torch.uint8
        # Uninitialised: a slot is only read after it was written (reads stop at num_tokens), so
        # zeroing gigabytes up front would only cost start-up time. Block 0, the dummy block that
        # padding rows point at, is zeroed.
        self.tensors = {layer: torch.empty(shape, dtype=dtype, device=device) for layer in spec.layers}
        for t in self.tensors.values():
            t[0].zero_()

    def read(self, layer: int, slots: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        t = self.tensors[layer]
        if self.spec.fmt in RAW_FORMATS:
            return t.view(-1, t.shape[-1])[slots].to(out_dtype)
        return kernels.gather_dequantize(t, slots, self.spec.fmt, out_dtype)

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        t = self.tensors[layer]
        if self.spec.fmt in RAW_FORMATS:
            t.view(-1, t.shape[-1])[slots] = rows.to(t.dtype)
        else:
            kernels.quantize_scatter(rows.contiguous(), t, slots, self.spec.fmt)


class PoolRef:
    """One layer's tensor of a pool, addressed by slot tensors of any shape (the static-shape
    decode path's access; `PagedRows`/`PagedEntries` are the per-sequence one)."""

    def __init__(self, pool: Pool, layer: int, dtype: torch.dtype):
        self.pool, self.layer, self.dtype = pool, layer, dtype

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [...] → rows [..., width] in `dtype`."""
        return self.pool.read(self.layer, slots.reshape(-1), self.dtype).view(*slots.shape, -1)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [..., width] to slots [...] (duplicate slots only ever target the dummy block)."""
        self.pool.write(self.layer, slots.reshape(-1), rows.reshape(slots.numel(), -1))


class Slots:
    """Position → slot arithmetic for one sequence's block table.

    Every layer of a step asks for the same ranges, so the slot tensors are memoised, keyed by
    the range and the block ids it covers (a key that changes whenever the table does, so an
    entry is never stale): a step builds each range's tensor once, not once per layer (on a GPU
    each build is a host→device copy). At most MEMO_SIZE entries are kept, oldest dropped first."""

    MEMO_SIZE = 16

    def __init__(self, table: BlockTable, block_size: int, device):
        self.table, self.block_size, self.device = table, block_size, device
        self._memo: dict[tuple, torch.Tensor] = {}

    def _memoised(self, key: tuple, build) -> torch.Tensor:
        slots = self._memo.get(key)
        if slots is None:
            if len(self._memo) >= self.MEMO_SIZE:
                del self._memo[next(iter(self._memo))]
            slots = self._memo[key] = build()
        return slots

    def sliding(self, start: int, end: int) -> torch.Tensor:
        b = self.block_size
        if end <= start:
            return torch.empty(0, dtype=torch.long, device=self.device)
        first = start // b - self.table.sliding_first
        assert first >= 0, "reading a sliding block that was already released"
        ids = tuple(self.table.sliding[first : (end - 1) // b + 1 - self.table.sliding_first])

        def build() -> torch.Tensor:
            pos = torch.arange(start, end, device=self.device)
            return torch.tensor(ids, dtype=torch.long, device=self.device)[pos // b - start // b] * b + pos % b
        return self._memoised(("sliding", start, end, ids), build)

    def full(self, first_entry: int, end_entry: int, tokens_per_record: int) -> torch.Tensor:
        per_block = self.block_size // tokens_per_record
        if end_entry <= first_entry:
            return torch.empty(0, dtype=torch.long, device=self.device)
        lo = first_entry // per_block
        ids = tuple(self.table.full[lo : (end_entry - 1) // per_block + 1])

        def build() -> torch.Tensor:
            w = torch.arange(first_entry, end_entry, device=self.device)
            return torch.tensor(ids, dtype=torch.long, device=self.device)[w // per_block - lo] * per_block + w % per_block
        return self._memoised(("full", first_entry, end_entry, per_block, ids), build)


class PagedRows:
    """Per-token rows of a sliding pool (window KV or compressor state) for one layer."""

    def __init__(self, pool: Pool, layer: int, slots: Slots, dtype: torch.dtype):
        self.pool, self.layer, self.slots, self.dtype = pool, layer, slots, dtype

    def read(self, start: int, end: int) -> torch.Tensor:
        return self.pool.read(self.layer, self.slots.sliding(start, end), self.dtype)

    def write(self, start: int, rows: torch.Tensor) -> None:
        self.pool.write(self.layer, self.slots.sliding(start, start + rows.shape[0]), rows)


class PagedEntries:
    """Compressed records (entries or index keys) of a full pool for one layer, by entry index.

    Records of positions below the table's `frozen_tokens` live in prefix-cached blocks shared
    with other sequences: writes to them (a replay recomputing those positions) are dropped."""

    def __init__(self, pool: Pool, layer: int, slots: Slots, dtype: torch.dtype):
        self.pool, self.layer, self.slots, self.dtype = pool, layer, slots, dtype

    def read(self, count: int) -> torch.Tensor:
        return self.pool.read(self.layer, self.slots.full(0, count, self.pool.spec.tokens_per_record), self.dtype)

    def write(self, start: int, rows: torch.Tensor) -> None:
        m = self.pool.spec.tokens_per_record
        skip = min(rows.shape[0], max(0, self.slots.table.frozen_tokens // m - start))
        if skip:  # entries of shared blocks: already there, never changed
            start, rows = start + skip, rows[skip:]
            if not rows.shape[0]:
                return
        slots = self.slots.full(start, start + rows.shape[0], m)
        self.pool.write(self.layer, slots, rows)


class _CompressorView:
    def __init__(self, rows: PagedRows, entries: PagedEntries):
        self.rows, self.entries = rows, entries


class _LayerView:
    def __init__(self, window: PagedRows, compressor: _CompressorView | None, indexer: _CompressorView | None):
        self.window, self.compressor, self.indexer = window, compressor, indexer


class PagedSequence:
    """A sequence's state in the shared pools (every layer, MTP layers after the model's); same
    position-indexed contract as the dense `SequenceState`."""

    def __init__(self, cache: "KVCache", num_layers: int):
        self.cache = cache
        self.table = BlockTable()
        self._slots = Slots(self.table, cache.layout.block_size, cache.device)
        self._views: dict[int, _LayerView] = {}
        self.num_layers = num_layers

    def sliding_slots(self, start: int, end: int) -> torch.Tensor:
        """Flat slot ids of positions [start, end) in the sliding pools ([end − start], long)."""
        return self._slots.sliding(start, end)

    def layer(self, index: int) -> "_LayerView":
        view = self._views.get(index)
        if view is None:
            assert 0 <= index < self.num_layers, index
            view = self._views[index] = self.cache._layer_view(index, self._slots)
        return view


class KVCache:
    """All pools of a layout, preallocated, plus the block manager that hands out their blocks."""

    def __init__(self, cfg: ModelConfig, layout: KVLayout, num_full_blocks: int, num_sliding_blocks: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", slack: int = 8, snapshot_slots: int = 0):
        self.cfg, self.layout, self.dtype, self.device = cfg, layout, dtype, device
        self.num_mtp_layers = max(layout.pool("swa").layers) + 1 - cfg.num_layers  # window-only layers
        self.manager = BlockManager(layout, num_full_blocks, num_sliding_blocks, slack)
        self.pools = {
            spec.name: Pool(spec, num_full_blocks if spec.group == "full" else num_sliding_blocks,
                            layout.block_size, device)
            for spec in layout.pools
        }
        self._layer_pools: dict[int, dict[str, PoolRef]] = {}
        # Sliding-state snapshots at block boundaries (exact prefix-cache hits); None = none kept.
        self.snapshots = SnapshotStore(self, snapshot_slots) if snapshot_slots else None

    @classmethod
    def for_model(cls, model, kv_dtype: str = "auto", max_num_seqs: int = 64, max_tokens_per_step: int = 2048,
                  num_full_blocks: int | None = None, memory_bytes: int | None = None, block_size: int = 256,
                  slack: int = 8, snapshot_slots: int = 0) -> "KVCache":
        """Pools for `model`: growable blocks from `num_full_blocks` or from what `memory_bytes`
        leaves after the sliding (per-sequence) blocks of `max_num_seqs` sequences and the
        `snapshot_slots` sliding-state snapshots (engine/kv_snapshot.py; with `memory_bytes`,
        as many of them as fit in an eighth of what the sliding blocks leave)."""
        compute = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[model.dtype]
        layout = build_layout(model.cfg, kv_dtype, compute, block_size, num_mtp_layers=len(model.mtp))
        sliding = cls.blocks_for(layout, max_num_seqs, max_tokens_per_step, slack)
        if num_full_blocks is None:
            if memory_bytes is None:
                raise ValueError("give num_full_blocks or memory_bytes")
            left = memory_bytes - sliding * layout.group_block_bytes("sliding")
            # Snapshots take at most an eighth of what the sliding blocks leave: fewer snapshots
            # only mean more exact replays, fewer global blocks mean fewer cached prefixes.
            snapshot_slots = min(snapshot_slots, max(0, left // 8) // max(1, snapshot_bytes(layout)))
            left -= snapshot_slots * snapshot_bytes(layout)
            num_full_blocks = left // max(1, layout.group_block_bytes("full"))
            if num_full_blocks < 2:
                raise ValueError(f"KV memory {memory_bytes} bytes is too small for {max_num_seqs} sequences")
        return cls(model.cfg, layout, num_full_blocks, sliding, model.dtype, model.device, slack, snapshot_slots)

    @staticmethod
    def blocks_for(layout: KVLayout, max_num_seqs: int, max_tokens_per_step: int, slack: int = 8) -> int:
        """Sliding blocks that `max_num_seqs` sequences need at once, the largest step included."""
        b = layout.block_size
        per_seq = -(-layout.sliding_keep(slack) // b) + 2
        return max_num_seqs * per_seq + -(-max_tokens_per_step // b) + 1

    @property
    def nbytes(self) -> int:
        pools = sum(t.numel() * t.element_size() for p in self.pools.values() for t in p.tensors.values())
        return pools + (self.snapshots.nbytes if self.snapshots is not None else 0)

    def _layer_view(self, layer: int, slots: Slots) -> _LayerView:
        cfg, dt = self.cfg, self.dtype
        window = PagedRows(self.pools["swa"], layer, slots, dt)
        if layer >= cfg.num_layers or cfg.compress_ratios[layer] == 0:
            return _LayerView(window, None, None)
        m, kind = cfg.compress_ratios[layer], cfg.layer_kinds[layer]
        src = lambda name: self.layout.source_layer(name, layer)  # noqa: E731
        state = self.pools[f"state_c{m}_{kind}"]
        entries = self.pools[f"c{m}"]
        compressor = _CompressorView(PagedRows(state, src(state.spec.name), slots, torch.float32),
                                     PagedEntries(entries, src(entries.spec.name), slots, dt))
        indexer = None
        if kind == "csa":
            keys, rows = self.pools[f"idx{m}"], self.pools[f"state_idx{m}"]
            indexer = _CompressorView(PagedRows(rows, src(rows.spec.name), slots, torch.float32),
                                      PagedEntries(keys, src(keys.spec.name), slots, dt))
        return _LayerView(window, compressor, indexer)

    def layer_pools(self, layer: int) -> dict[str, PoolRef]:
        """The pools `layer` reads and writes: 'window', and for compressed layers 'comp_rows' /
        'comp_entries', and for CSA layers 'index_rows' / 'index_keys'. Built once per layer."""
        cached = self._layer_pools.get(layer)
        if cached is not None:
            return cached
        view = self._layer_view(layer, None)
        refs = {"window": view.window}
        if view.compressor is not None:
            refs.update(comp_rows=view.compressor.rows, comp_entries=view.compressor.entries)
        if view.indexer is not None:
            refs.update(index_rows=view.indexer.rows, index_keys=view.indexer.entries)
        cached = self._layer_pools[layer] = {name: PoolRef(r.pool, r.layer, r.dtype) for name, r in refs.items()}
        return cached

    def new_sequence(self) -> PagedSequence:
        """State of every layer of one sequence (the MTP layers share its block table: same
        positions, so their windows cost no extra allocation)."""
        return PagedSequence(self, self.cfg.num_layers + self.num_mtp_layers)

    def allocate(self, seq: PagedSequence, start: int, end: int) -> bool:
        return self.manager.allocate(seq.table, start, end)

    def free(self, seq: PagedSequence) -> None:
        self.manager.free(seq.table)

    def zero_sliding(self, seq: PagedSequence, start: int, end: int) -> None:
        """Zero every sliding pool's rows of positions [start, end) (held by `seq`): what a replay
        reads before its first position is then defined (zeros), not a recycled block's bytes."""
        if end <= start:
            return
        slots = seq.sliding_slots(start, end)
        for pool in self.pools.values():
            if pool.spec.group != "sliding":
                continue
            for t in pool.tensors.values():
                t.view(-1, *t.shape[2:])[slots] = 0
