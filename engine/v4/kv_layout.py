"""DeepSeek-V4's KV layout: every compressed layer owns its compressor and its pools (the pool
kinds, record formats and groups: engine/kv_layout.py)."""

from __future__ import annotations

from ..config import ModelConfig
from ..kv_layout import KV_DTYPES, KVLayout, PoolSpec, record_bytes


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
