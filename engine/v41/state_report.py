"""The fixed (length-independent) per-sequence state of a V4.1 sequence, item by item, for
`ringserve kv-report`: what the window pools hold, the ratio-2 compressor tails, the Engram
hash history and the DSpark stage windows."""

from __future__ import annotations

INT64_BYTES = 8


def fixed_state(cfg, layout) -> list[dict]:
    v, items = cfg.v41, []
    swa = layout.pool("swa")
    backbone = [layer for layer in swa.layers if layer < cfg.num_layers]
    stages = len(swa.layers) - len(backbone)
    items.append({"what": f"window KV: {len(backbone)} layers x {swa.window} rows x {swa.record_bytes} B ({swa.fmt})",
                  "bytes": len(backbone) * swa.window * swa.record_bytes})
    for p in layout.pools:
        if p.name.startswith("state_"):
            items.append({"what": f"compressor tails: {len(p.layers)} sources x {p.window} row x {p.record_bytes} B "
                                  f"(fp32 kv|score)", "bytes": p.per_sequence_bytes})
    if stages:
        items.append({"what": f"DSpark windows: {stages} stages x {swa.window} rows x {swa.record_bytes} B",
                      "bytes": stages * swa.window * swa.record_bytes})
    if v.engram_layer_ids:
        lookback = v.engram_max_ngram_size - 1
        items.append({"what": f"Engram hash history: {lookback} compressed ids (int64) by position",
                      "bytes": lookback * INT64_BYTES})
    return items
