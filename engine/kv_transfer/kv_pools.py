"""ringserve's KV pools as transport regions, and which blocks of a sequence cross.

Region = one pool (`engine/kv_cache.py` `Pool`): its tensors in writer-layer order, each
[num_blocks, records_per_block, record_bytes] (or raw-dtype rows). Every pool of a group is
indexed by the same block table, so a group's blocks cross as one READ over all its regions
with the same ids (`KVTransport.read(peer, group_regions[g], remote_ids, local_ids)`).

What crosses after a prompt of n tokens (`handoff_blocks`): every full-group block of the prompt
(compressed KV and index keys since position 0) and the sliding-group blocks that overlap the
trailing `sliding_keep` positions (window KV and compressor state), i.e. what the decode's own
BlockManager would keep readable at position n. Per-block digests go per group over the
group's tensors in region order (`group_tensors`).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ipc.kv_transfer_params import GROUPS

from .protocol import expected_blocks

if TYPE_CHECKING:
    import torch

    from engine.block_manager import BlockTable
    from engine.config import ModelConfig
    from engine.kv_cache import KVCache
    from engine.kv_layout import KVLayout


def pool_regions(cache: "KVCache") -> dict[str, list["torch.Tensor"]]:
    """{pool name: its tensors in writer-layer order} for `KVTransport.register`."""
    return {name: [pool.tensors[layer] for layer in pool.spec.layers] for name, pool in cache.pools.items()}


def group_regions(layout: "KVLayout") -> dict[str, list[str]]:
    """{group: its pool names, sorted} (the transport orders regions by name too)."""
    return {g: sorted(p.name for p in layout.pools if p.group == g) for g in GROUPS}


def group_tensors(cache: "KVCache", group: str) -> list["torch.Tensor"]:
    """Every tensor of a group, regions sorted by name, layers in order: the digest's order."""
    regions = pool_regions(cache)
    return [t for name in group_regions(cache.layout)[group] for t in regions[name]]


def compat_identity(cfg: "ModelConfig", layout: "KVLayout", *, model_id: str, compute_dtype: str,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What makes two engines' KV interchangeable: the weights (`model_id`: name plus revision
    or a weight hash, the caller's), the whole model config (quantization included), the
    compute dtype and the KV layout (pools, formats, block size, cross-layer sources)."""
    config = dataclasses.asdict(cfg)
    config["quantization"] = cfg.quantization
    return {
        "model_id": model_id,
        "config": config,
        "compute_dtype": compute_dtype,
        "block_size": layout.block_size,
        "kv_dtype": layout.kv_dtype,
        "pools": [dataclasses.asdict(p) for p in layout.pools],
        "source": sorted([pool, reader, writer] for (pool, reader), writer in layout.source.items()),
        **(extra or {}),
    }


def handoff_blocks(table: "BlockTable", num_tokens: int, block_size: int, sliding_keep: int) -> dict[str, tuple[int, list[int]]]:
    """{group: (first logical block, block ids)} a decode needs to continue after `num_tokens`.
    The sequence must still hold them (a finished remote-decode prefill holds all of them)."""
    want = expected_blocks(num_tokens, block_size, sliding_keep)
    first, end = want["full"]
    if len(table.full) < end:
        raise ValueError(f"table holds {len(table.full)} full blocks, {end} needed for {num_tokens} tokens")
    s_first, s_end = want["sliding"]
    have = (table.sliding_first, table.sliding_first + len(table.sliding))
    if s_first < have[0] or s_end > have[1]:
        raise ValueError(f"table holds sliding blocks [{have[0]}, {have[1]}), [{s_first}, {s_end}) needed")
    return {"full": (0, list(table.full[:end])),
            "sliding": (s_first, [table.sliding_id(i) for i in range(s_first, s_end)])}


def plan_block_ids(table: "BlockTable", blocks: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """{group: the table's block ids of the plan's logical blocks [first, end)}; ValueError if
    the table does not hold them all."""
    first, end = blocks["full"]
    if len(table.full) < end:
        raise ValueError(f"table holds {len(table.full)} full blocks, {end} needed")
    s_first, s_end = blocks["sliding"]
    have = (table.sliding_first, table.sliding_first + len(table.sliding))
    if s_end > s_first and (s_first < have[0] or s_end > have[1]):
        raise ValueError(f"table holds sliding blocks [{have[0]}, {have[1]}), [{s_first}, {s_end}) needed")
    return {"full": list(table.full[first:end]), "sliding": [table.sliding_id(i) for i in range(s_first, s_end)]}
