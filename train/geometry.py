"""Model geometries the recipe trains: the built-in model and a tiny one for the recipe's test.

Both keep every V4 mechanism of the presets in engine/checkpoint.py (four mHC streams with
Sinkhorn mixing, a sliding-window layer, CSA layers with the overlapping compressor and the
lightning indexer, an HCA layer, a hash-routed MoE layer then learned top-k MoE layers with a
shared expert, one MTP layer) at sizes that train on two CPU cores: the built-in's window and
compress rates are scaled down with its 256-token training context, so that every attention
path (window, CSA top-k selection, HCA) is in use during training.
"""

from __future__ import annotations

from typing import Any

from engine.config import ModelConfig
from engine.v4.checkpoint import preset_config

_LAYERS = {"layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                           "compressed_sparse_attention"],
           "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"]}

BUILTIN: dict[str, Any] = {
    **_LAYERS, "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64,
    "qk_rope_head_dim": 16, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128, "sliding_window": 64,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16,
    "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "max_position_embeddings": 8192, "rope_scaling": None,
}

# index_topk above the number of compressed entries of its 32-token windows: the selection is
# then every visible entry, so logits comparisons cannot hinge on ties between index scores.
TINY: dict[str, Any] = {
    **_LAYERS, "num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 2, "head_dim": 16,
    "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "sliding_window": 8,
    "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 32,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "max_position_embeddings": 1024, "rope_scaling": None,
}

GEOMETRIES = {"builtin": BUILTIN, "tiny": TINY}


def model_config(geometry: str, vocab_size: int) -> ModelConfig:
    """The ModelConfig of a named geometry with the trained tokenizer's vocabulary size."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown geometry {geometry!r}; choose one of {sorted(GEOMETRIES)}")
    # The base preset only supplies the V4 constants (_BASE in engine/checkpoint.py); every
    # size is overridden here.
    return preset_config("tiny", **GEOMETRIES[geometry], vocab_size=vocab_size)
