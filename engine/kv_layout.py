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


def _formats(cfg: ModelConfig, kv_dtype: str, compute_dtype: str) -> tuple[str, str, str]:
    """(window format, compressed-entry format, index-key format) for a --kv-dtype."""
    if kv_dtype == "auto":
        return compute_dtype, compute_dtype, compute_dtype
    if kv_dtype == "bf16":
        return "bf16", "bf16", "bf16"
    if cfg.rope_dim != 64:
        raise ValueError(f"--kv-dtype {kv_dtype} stores the 64 rope dims in bf16 and needs qk_rope_head_dim 64 "
                         f"(this model has {cfg.rope_dim})")
    compressed = "fp8_ds_mla" if kv_dtype == "fp8" else "fp4_kv"
    # The window stays fp8 under fp4: it is the part every query reads at full weight.
    return "fp8_ds_mla", compressed, "fp4_index"


def build_layout(cfg: ModelConfig, kv_dtype: str = "auto", compute_dtype: str = "fp32", block_size: int = 256,
                 num_mtp_layers: int | None = None, index_dtype: str = "fp4") -> KVLayout:
    """The layout of `cfg`'s architecture (engine/models/: V4 `build_v4_layout`, V4.1 `build_v41_layout`)."""
    return registry.of(cfg).kv_layout(cfg, kv_dtype, compute_dtype, block_size, num_mtp_layers, index_dtype)


def build_v4_layout(cfg: ModelConfig, kv_dtype: str = "auto", compute_dtype: str = "fp32", block_size: int = 256,
                    num_mtp_layers: int | None = None, index_dtype: str = "fp4") -> KVLayout:
    """The V4 layout: every compressed layer owns its compressor and its pools."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    mtp = cfg.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
    win_fmt, entry_fmt, index_fmt = _formats(cfg, kv_dtype, compute_dtype)
    for fmt, width in ((win_fmt, cfg.head_dim), (entry_fmt, cfg.head_dim), (index_fmt, cfg.index_head_dim)):
        record_bytes(fmt, width)  # raises a clear ValueError for dims the format cannot hold
    layers = range(cfg.num_layers)
    pools = [PoolSpec("swa", "sliding", win_fmt, cfg.head_dim, 1, cfg.sliding_window,
                      tuple(layers) + tuple(cfg.num_layers + i for i in range(mtp)))]
    for m in sorted({r for r in cfg.compress_ratios if r}):
        if block_size % m:
            raise ValueError(f"block size {block_size} is not a multiple of compress ratio {m}")
        writers = tuple(i for i in layers if cfg.compress_ratios[i] == m)
        csa = tuple(i for i in writers if cfg.layer_kinds[i] == "csa")
        hca = tuple(i for i in writers if cfg.layer_kinds[i] == "hca")
        pools.append(PoolSpec(f"c{m}", "full", entry_fmt, cfg.head_dim, m, 0, writers))
        if csa:
            pools.append(PoolSpec(f"idx{m}", "full", index_fmt, cfg.index_head_dim, 1 * m, 0, csa))
            # Overlapping compressors keep the previous window too; rows are [C | Z], C and Z 2·dim wide.
            pools.append(PoolSpec(f"state_c{m}_csa", "sliding", "fp32", 4 * cfg.head_dim, 1, 2 * m, csa))
            pools.append(PoolSpec(f"state_idx{m}", "sliding", "fp32", 4 * cfg.index_head_dim, 1, 2 * m, csa))
        if hca:
            pools.append(PoolSpec(f"state_c{m}_hca", "sliding", "fp32", 2 * cfg.head_dim, 1, m, hca))
    return KVLayout(block_size, kv_dtype, tuple(pools))


def _v41_formats(kv_dtype: str, index_dtype: str) -> tuple[str, str, str]:
    """(window, compressed entry, index key) formats. V4.1's values are QAT-quantized by the
    model itself, so every format here holds them exactly: bf16 (auto, bf16), or the model's own
    records (fp8, fp4: the window's e4m3 per 32, FP4 e4m3/16 entries, FP4 ue8m0/32 keys)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if index_dtype not in ("fp4", "fp8"):
        raise ValueError(f"index key dtype must be fp4 or fp8, got {index_dtype!r}")
    if kv_dtype in ("auto", "bf16"):
        return "bf16", "bf16", "bf16"
    return "v41_fp8", "fp4_kv", "v41_fp4_index" if index_dtype == "fp4" else "fp8_index"


def build_v41_layout(cfg: ModelConfig, kv_dtype: str = "auto", block_size: int = 256,
                     num_stages: int | None = None, index_dtype: str = "fp4") -> KVLayout:
    """The V4.1 layout (CSA2 cross-layer sharing). Pools:
      * `swa`      sliding: every layer's window rows, then each DSpark stage's window;
      * `c{m}`     full: compressed KV, one record per m tokens, written by the ratio-m sources only;
      * `idx{m}`   full: index keys (from the source's pre-RoPE latent), same writers;
      * `state_c2` sliding: the ratio-2 sources' fp32 [kv | score] rows of a group still filling
                   (window ratio − 1 = 1 position); ratio 1 keeps no compressor state.
    Every ratio-m layer reads its group source's `c{m}` / `idx{m}` (the `source` map)."""
    v = cfg.v41
    stages = cfg.num_nextn_predict_layers if num_stages is None else num_stages
    win_fmt, entry_fmt, index_fmt = _v41_formats(kv_dtype, index_dtype)
    layers = range(cfg.num_layers)
    pools = [PoolSpec("swa", "sliding", win_fmt, cfg.head_dim, 1, cfg.sliding_window,
                      tuple(layers) + tuple(cfg.num_layers + i for i in range(stages)))]
    source: dict[tuple[str, int], int] = {}
    for m in sorted({r for r in cfg.compress_ratios if r}):
        if block_size % m:
            raise ValueError(f"block size {block_size} is not a multiple of compress ratio {m}")
        writers = tuple(s for s in v.kv_source_layers if cfg.compress_ratios[s] == m)
        pools.append(PoolSpec(f"c{m}", "full", entry_fmt, cfg.head_dim, m, 0, writers))
        pools.append(PoolSpec(f"idx{m}", "full", index_fmt, cfg.index_head_dim, m, 0, writers))
        if m > 1:  # rows [kv | score] of the group still filling: at most m − 1 positions back
            pools.append(PoolSpec(f"state_c{m}", "sliding", "fp32", 2 * cfg.head_dim, 1, m - 1, writers))
        for layer in layers:
            if cfg.compress_ratios[layer] == m:
                for name in (f"c{m}", f"idx{m}", f"state_c{m}"):
                    source[(name, layer)] = v.kv_source_of(layer)
    return KVLayout(block_size, kv_dtype, tuple(pools), source)
