"""Which KV pools a model needs, their record formats and their bytes per token.

Every entry kind gets its own pool, sized from its own record:
  * `swa`            post-RoPE window KV, one record per token, every layer (+ MTP layers);
  * `c{m}`           compressed KV, one record per m tokens, the layers with compress ratio m;
  * `idx{m}`         lightning-indexer keys, one record per m tokens, the CSA layers;
  * `state_*`        compressor partial-window rows [C | Z + ape] in fp32, one per token.
Pools are in one of two groups. `full` pools keep a record for every position since the start
(they grow with context); `sliding` pools only need their last `window` positions (fixed
per-sequence state). Within a group every pool is indexed by the same block table, so one
logical block of `block_size` tokens is one block id in every pool of the group.

A pool is written by its `layers`; `source` maps a reading layer to the layer whose pool it
reads. In V4 every layer reads its own pool; V4.1's cross-layer sharing (a few source layers
write compressed KV that many layers read) is the same pools with a non-identity `source`
(`build_v41_layout`): `c{m}` / `idx{m}` have only the KV sources as writers, and every ratio-m
layer of a group reads its source's records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import kernels

from .config import ModelConfig
from .models import registry

KV_DTYPES = ("auto", "bf16", "fp8", "fp4")
RAW_FORMATS = {"bf16": 2, "fp16": 2, "fp32": 4}
# V4.1 record formats beyond the kernels' (engine/v41/records.py): the window's e4m3 with a
# ue8m0 scale per 32 over every channel, FP4 index keys with ue8m0 per 32, and FP8 index keys
# with one fp32 scale (vLLM's `indexer_kv_dtype: fp8`; sized for reports, not stored).
V41_FORMATS = {"v41_fp8": lambda d: d + d // 32, "v41_fp4_index": lambda d: d // 2 + d // 32,
               "fp8_index": lambda d: d + 4}


def record_bytes(fmt: str, width: int) -> int:
    if fmt in RAW_FORMATS:
        return RAW_FORMATS[fmt] * width
    if fmt in V41_FORMATS:
        return V41_FORMATS[fmt](width)
    return kernels.get_format(fmt, width).record_bytes


@dataclass(frozen=True)
class PoolSpec:
    name: str
    group: str  # 'full' or 'sliding'
    fmt: str  # a kernels record format, or a raw dtype name ('bf16', 'fp32')
    width: int  # values per record
    tokens_per_record: int  # 1, or the compress ratio m
    window: int  # sliding pools: trailing positions the maths reads (0 for full pools)
    layers: tuple[int, ...]  # writer layers (MTP layers numbered after the model's)

    @property
    def record_bytes(self) -> int:
        return record_bytes(self.fmt, self.width)

    @property
    def bytes_per_token(self) -> float:
        return self.record_bytes * len(self.layers) / self.tokens_per_record

    @property
    def per_sequence_bytes(self) -> int:
        """Bytes of the window a sliding pool must hold per sequence (0 for full pools)."""
        return self.record_bytes * len(self.layers) * self.window


@dataclass(frozen=True)
class KVLayout:
    block_size: int
    kv_dtype: str
    pools: tuple[PoolSpec, ...]
    source: dict[tuple[str, int], int] = field(default_factory=dict)  # (pool, reader layer) → writer layer

    def pool(self, name: str) -> PoolSpec:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def source_layer(self, pool: str, layer: int) -> int:
        return self.source.get((pool, layer), layer)

    @property
    def global_bytes_per_token(self) -> float:
        return sum(p.bytes_per_token for p in self.pools if p.group == "full")

    @property
    def per_sequence_bytes(self) -> int:
        return sum(p.per_sequence_bytes for p in self.pools if p.group == "sliding")

    def group_block_bytes(self, group: str) -> int:
        """Bytes one block id occupies across every pool of `group`."""
        return sum(p.record_bytes * len(p.layers) * (self.block_size // p.tokens_per_record)
                   for p in self.pools if p.group == group)

    def sliding_keep(self, slack: int) -> int:
        """Trailing positions the sliding group must keep readable, speculative slack included."""
        return max((p.window for p in self.pools if p.group == "sliding"), default=0) + slack


def build_layout(cfg: ModelConfig, kv_dtype: str = "auto", compute_dtype: str = "fp32", block_size: int = 256,
                 num_mtp_layers: int | None = None, index_dtype: str = "fp4") -> KVLayout:
    """The layout of `cfg`'s architecture (engine/models/: V4 `build_v4_layout`, V4.1 `build_v41_layout`)."""
    return registry.of(cfg).kv_layout(cfg, kv_dtype, compute_dtype, block_size, num_mtp_layers, index_dtype)
