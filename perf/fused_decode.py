"""The fused decode forward now lives in the engine (engine/v4/fused_decode.py, run by
`StaticDecodeBackend`); this name stays for callers of the former prototype."""
from __future__ import annotations

from engine.decode_batch import DecodeBatch
from engine.v4.fused_decode import FusedDecoder


def fused_forward(model, batch: DecodeBatch, on_layer=None):
    """DeepseekV4.forward(batch.token_ids, batch.positions, batch) through the fused kernels."""
    decoder = FusedDecoder(model)
    decoder.on_layer = on_layer
    return decoder.forward(batch)
