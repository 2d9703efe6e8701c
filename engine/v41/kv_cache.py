"""V4.1's paged KV pools and each sequence's view onto them (plus its Engram history).

Same machinery as V4 (engine/kv_cache.py): one `Pool` per `PoolSpec` of the V4.1 layout
(engine/kv_layout.py `build_v41_layout`), block tables from the `BlockManager`, slots by
position. What V4.1 adds:
  * reads follow the layout's `source` map: every ratio-m layer reads its KV source's `c{m}` /
    `idx{m}` records (written once, by the source);
  * a pool receives rows *before* quantization and stores them quantized the model's way: raw
    pools hold the fake-quantized values, record pools (`v41_fp8`, `fp4_kv`, `v41_fp4_index`)
    the codes, so every read returns exactly what the model computes with;
  * each sequence carries its Engram compressed-id history (engine/v41/engram.py) and, as
    layers `num_layers + s` of the window pool, each DSpark stage's window.
Everything is indexed by absolute position, so rollback is recomputation from a lower position.

Prefix caching (engine/prefix_cache.py) needs no V4.1 machinery beyond V4's: the DSpark windows
are layers of the window pool, so sliding-state snapshots and replays cover them; the records a
hit adopts are only read (`PagedEntries` drops writes below `frozen_tokens`); and the Engram
history at the hit is rebuilt from the token ids (`rebuild_history`).
"""

from __future__ import annotations

import torch

import kernels

from ..block_manager import BlockTable
from ..kv_cache import KVCache, PagedEntries, PagedRows, Pool, Slots
from ..kv_layout import RAW_FORMATS, KVLayout, PoolSpec
from . import records
from .kv_layout import build_v41_layout
from .quant import fake_fp4_index, fake_fp4_kv, fake_fp8

# The model's quantizer of each pool kind (state rows are fp32 maths, not quantized).
_FAKE = {"swa": fake_fp8, "c": fake_fp4_kv, "idx": fake_fp4_index}


def _kind(name: str) -> str:
    return "swa" if name == "swa" else "state" if name.startswith("state") else "idx" if name.startswith("idx") else "c"


class V41Pool(Pool):
    def __init__(self, spec: PoolSpec, num_blocks: int, block_size: int, device):
        super().__init__(spec, num_blocks, block_size, device)
        self.fake = _FAKE.get(_kind(spec.name))

    def read(self, layer: int, slots: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if self.spec.fmt in records.OWN_FORMATS:
            t = self.tensors[layer]
            return records.decode(t.view(-1, t.shape[-1])[slots], self.spec.fmt, self.spec.width, out_dtype)
        return super().read(layer, slots, out_dtype)

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows: values before the model's quantization (or fp32 state rows)."""
        if self.spec.fmt in RAW_FORMATS:
            super().write(layer, slots, self.fake(rows) if self.fake is not None else rows)
        elif self.spec.fmt in records.OWN_FORMATS:
            t = self.tensors[layer]
            t.view(-1, t.shape[-1])[slots] = records.encode(rows, self.spec.fmt)
        else:  # fp4_kv: the kernels' record rules are V4.1's compressed-KV quantizer
            kernels.quantize_scatter(rows.float().contiguous(), self.tensors[layer], slots, self.spec.fmt)


class Entries(PagedEntries):
    def read_some(self, index: torch.Tensor) -> torch.Tensor:
        """Records at entry indices [M] (each < the sequence's count)."""
        per_block = self.pool.records_per_block
        ids = torch.tensor(self.slots.table.full, dtype=torch.long, device=index.device)
        slots = ids[index // per_block] * per_block + index % per_block
        return self.pool.read(self.layer, slots, self.dtype)


class V41Sequence:
    """One sequence's state: its block table (every pool), views by layer, Engram history."""

    def __init__(self, cache: "V41KVCache"):
        self.cache = cache
        self.table = BlockTable()
        self._slots = Slots(self.table, cache.layout.block_size, cache.device)
        self.engram = cache.new_engram_history()
        self.multimodal = None  # the request's images (engine/v41/vision/inputs.py RequestImages), if any
        self._views: dict[tuple[str, int], object] = {}

    def _view(self, pool: str, layer: int, cls, dtype):
        key = (pool, layer)
        view = self._views.get(key)
        if view is None:
            writer = self.cache.layout.source_layer(pool, layer)
            view = self._views[key] = cls(self.cache.pools[pool], writer, self._slots, dtype)
        return view

    def sliding_slots(self, start: int, end: int) -> torch.Tensor:
        """Flat slot ids of positions [start, end) in the sliding pools ([end − start], long)."""
        return self._slots.sliding(start, end)

    def window(self, layer: int) -> PagedRows:
        """Window rows of a backbone layer, or of DSpark stage s as layer num_layers + s."""
        return self._view("swa", layer, PagedRows, self.cache.dtype)

    def tail(self, layer: int) -> PagedRows:
        """A ratio-2 source's fp32 [kv | score] rows of its group still filling."""
        return self._view(f"state_c{self.cache.cfg.compress_ratios[layer]}", layer, PagedRows, torch.float32)

    def entries(self, layer: int) -> Entries:
        """Compressed KV records that `layer` reads (its source's)."""
        return self._view(f"c{self.cache.cfg.compress_ratios[layer]}", layer, Entries, self.cache.dtype)

    def keys(self, layer: int) -> Entries:
        """Index keys of `layer`'s source."""
        return self._view(f"idx{self.cache.cfg.compress_ratios[layer]}", layer, Entries, self.cache.dtype)


class V41KVCache(KVCache):
    """All pools of a V4.1 layout plus the block manager (KVCache's allocation and sizing)."""

    def __init__(self, cfg, layout: KVLayout, num_full_blocks: int, num_sliding_blocks: int, dtype: torch.dtype,
                 device="cpu", slack: int = 8, engram=None, snapshot_slots: int = 0):
        from ..block_manager import BlockManager
        from ..kv_snapshot import SnapshotStore

        self.cfg, self.layout, self.dtype, self.device = cfg, layout, dtype, device
        self.num_mtp_layers = max(layout.pool("swa").layers) + 1 - cfg.num_layers
        self.manager = BlockManager(layout, num_full_blocks, num_sliding_blocks, slack)
        self.pools = {spec.name: V41Pool(spec, num_full_blocks if spec.group == "full" else num_sliding_blocks,
                                         layout.block_size, device) for spec in layout.pools}
        self._layer_pools = {}
        self.slack, self.engram = slack, engram
        # Sliding-state snapshots at block boundaries (exact prefix-cache hits); None = none kept.
        self.snapshots = SnapshotStore(self, snapshot_slots) if snapshot_slots else None

    @classmethod
    def for_model(cls, model, kv_dtype: str = "auto", max_num_seqs: int = 64, max_tokens_per_step: int = 2048,
                  num_full_blocks: int | None = None, memory_bytes: int | None = None, block_size: int = 256,
                  slack: int = 8, snapshot_slots: int = 0) -> "V41KVCache":
        """As `KVCache.for_model`: with `memory_bytes`, snapshots take at most an eighth of what
        the sliding blocks leave, the global blocks the rest."""
        from ..kv_snapshot import snapshot_bytes

        layout = build_v41_layout(model.cfg, kv_dtype, block_size, num_stages=len(model.mtp))
        sliding = cls.blocks_for(layout, max_num_seqs, max_tokens_per_step, slack)
        if num_full_blocks is None:
            if memory_bytes is None:
                raise ValueError("give num_full_blocks or memory_bytes")
            left = memory_bytes - sliding * layout.group_block_bytes("sliding")
            snapshot_slots = min(snapshot_slots, max(0, left // 8) // max(1, snapshot_bytes(layout)))
            left -= snapshot_slots * snapshot_bytes(layout)
            num_full_blocks = left // max(1, layout.group_block_bytes("full"))
            if num_full_blocks < 2:
                raise ValueError(f"KV memory {memory_bytes} bytes is too small for {max_num_seqs} sequences")
        return cls(model.cfg, layout, num_full_blocks, sliding, model.dtype, model.device, slack, model.hasher,
                   snapshot_slots)

    def new_engram_history(self):
        from .engram import EngramHistory

        if self.engram is None:
            return None
        return EngramHistory(self.engram.lookback + self.slack + 1, self.engram.pad)

    def new_sequence(self) -> V41Sequence:
        return V41Sequence(self)

    def rebuild_history(self, seq: V41Sequence, token_ids: list[int], start: int) -> None:
        """A prefix-cache hit computes `seq` from `start`: write the Engram history that
        computing from there looks back on (positions [start − lookback, start)).

        Rebuilt, not snapshotted: the history is the compressed ids of the tokens, a pure
        function of them, and a hit's tokens below `start` are the cached ones (the hash chain
        matched), so a few table lookups give it exactly, for snapshots and replays alike. Image
        positions are DEAD, as the prefill recorded them (the hash chain covers the images too)."""
        if seq.engram is None or start <= 0:
            return
        lo = max(0, start - self.engram.lookback)
        dead = torch.tensor(seq.multimodal.mask(lo, start)) if seq.multimodal is not None else None
        seq.engram.write(lo, self.engram.record_ids(torch.tensor(token_ids[lo:start], dtype=torch.long), dead))

    def layer_pools(self, layer: int):
        raise NotImplementedError("V4.1's static decode step reads its pools itself (engine/v41/static_forward.py)")
