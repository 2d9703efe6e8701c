"""DeepSeek-V4.1's KV layout: CSA2's cross-layer sharing (a ratio-m layer reads its group
source's pools) in the model's own record formats (the pool kinds and groups: engine/kv_layout.py)."""

from __future__ import annotations

from ..config import ModelConfig
from ..kv_layout import KV_DTYPES, KVLayout, PoolSpec


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
