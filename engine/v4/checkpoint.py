"""Random-weight DeepSeek-V4 checkpoints (`ringserve make-model`): presets, init and writing.

Weights are drawn deterministically from (seed, tensor name), scaled so that activations stay
O(1) through the stack (which keeps greedy tokens away from near-ties), and written as
Hugging Face safetensors shards in the upstream or the transformers layout. With
`quantize="fp8-fp4"` the dense projections are stored as FP8 e4m3 with ue8m0 block scales and
the routed experts as FP4 e2m1 with ue8m0 scales per 32 (engine/checkpoint.py), the formats of
the released checkpoints; the model those bytes describe is then the dequantized one.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import quantize_fp4_rows, quantize_fp8_blocks, write_shards
from ..config import ModelConfig
from .weight_formats import released_fp8
from .weight_names import export_names
from .weights import build_model, keeps_fp32


_BASE: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "rms_norm_eps": 1e-6,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 10.0,
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "scoring_func": "sqrtsoftplus",
    "n_shared_experts": 1,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 1,
}

PRESETS: dict[str, dict[str, Any]] = {
    # Runs the whole test suite in seconds; HCA rate 8 so the heavy compressor fires on short inputs.
    "tiny": {
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 32,
        "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "max_position_embeddings": 1024,
        "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
    },
    # Tens of millions of parameters with the real attention geometry (head_dim 512, window 128,
    # rates 4/128, index 64×128 top-512, 64 experts top-6): the benchmark model.
    "small": {
        "vocab_size": 8192, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 16, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 256, "o_groups": 4, "o_lora_rank": 256, "sliding_window": 128,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 128,
        "max_position_embeddings": 1048576,
        "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    },
}


def preset_config(preset: str, **overrides: Any) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig.from_dict({**_BASE, **PRESETS[preset], **overrides})


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _init_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    g = _generator(seed, name)
    leaf = name.rpartition(".")[2]
    randn = lambda scale: torch.randn(shape, generator=g) * scale  # noqa: E731
    if leaf == "tid2eid":  # distinct experts per token
        scores = torch.rand((shape[0], cfg.n_routed_experts), generator=g)
        return scores.argsort(dim=-1)[:, : shape[1]].to(torch.int32)
    if leaf in ("norm", "q_norm", "kv_norm", "attn_norm", "ffn_norm", "enorm", "hnorm"):
        return 1.0 + randn(0.1)
    if leaf == "scale":
        return 1.0 + randn(0.2)
    if leaf == "base":
        return randn(0.5)
    if leaf in ("attn_sink", "ape"):
        return randn(0.5)
    if leaf == "gate_bias":
        return randn(0.1)
    if leaf == "embed":
        return randn(1.0)
    fan_in = shape[-1]
    return randn(1.0 / math.sqrt(fan_in))


def _draw_name(internal: str) -> str:
    """The name a parameter had before projections became modules (engine/linear.py):
    `attn.wq_a.weight` was `attn.wq_a`, `ffn.experts.w13.weight` was `ffn.w13`. Draws are keyed
    by it, so every preset's random checkpoint stays byte-identical across the rename."""
    return internal.removesuffix(".weight").replace(".ffn.experts.", ".ffn.")


def random_state(cfg: ModelConfig, seed: int = 0, with_mtp: bool = True) -> dict[str, torch.Tensor]:
    """Internal parameter name (dense model, every expert) → fp32 (or int32) tensor."""
    model = build_model(cfg, with_mtp=with_mtp and cfg.num_nextn_predict_layers > 0)
    state = {}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        state[name] = _init_tensor(_draw_name(name), tuple(p.shape), cfg, seed)
    return state


def _fp8_block(cfg: ModelConfig) -> int:
    """128×128 blocks like the release when every quantized dim allows it, else 16×16."""
    dims = {cfg.hidden_size, cfg.q_lora_rank, cfg.num_heads * cfg.head_dim, cfg.head_dim, cfg.o_lora_rank,
            cfg.moe_intermediate_size, cfg.index_n_heads * cfg.index_head_dim, cfg.num_heads * cfg.head_dim // cfg.o_groups}
    for block in (128, 64, 32, 16):
        if all(d % block == 0 for d in dims):
            return block
    raise ValueError("fp8 quantization needs every projection dim to be a multiple of 16")


def _is_fp8(internal: str) -> bool:
    return internal.endswith(".weight") and released_fp8(internal.removesuffix(".weight"))


def export_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor], layout: str, dtype: torch.dtype,
                   quantize: str | None) -> dict[str, torch.Tensor]:
    """Checkpoint name → tensor, in `layout` and stored dtypes."""
    if quantize not in (None, "fp8-fp4"):
        raise ValueError(f"unknown quantization {quantize!r}")
    if quantize and layout != "upstream":
        raise ValueError("quantized checkpoints are written in the upstream layout (as released)")
    block = _fp8_block(cfg) if quantize else 0
    inter = cfg.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for internal, value in state.items():
        stored = value if not value.is_floating_point() else value.to(torch.float32 if keeps_fp32(internal) else dtype)
        for name, expert, part in export_names(internal, layout, cfg.n_routed_experts):
            if expert is not None:
                rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "all": slice(None)}[part]
                piece = value[expert, rows].contiguous()
                if quantize:
                    packed, scale = quantize_fp4_rows(piece.float())
                    out[name], out[name[: -len(".weight")] + ".scale"] = packed, scale
                else:
                    out[name] = piece.to(dtype)
            elif quantize and _is_fp8(internal):
                q, scale = quantize_fp8_blocks(value.float(), block)
                out[name], out[name[: -len(".weight")] + ".scale"] = q, scale
            else:
                out[name] = stored.contiguous()
    return out


def quantization_config(cfg: ModelConfig) -> dict[str, Any]:
    block = _fp8_block(cfg)
    return {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
            "weight_block_size": [block, block], "expert_dtype": "fp4"}


def write_checkpoint(out_dir: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor], layout: str = "upstream",
                     dtype: torch.dtype = torch.bfloat16, quantize: str | None = None,
                     shard_bytes: int = 512 * 2**20) -> Path:
    """Write config.json, generation_config.json and safetensors shards (+ index)."""
    if layout not in ("upstream", "transformers"):
        raise ValueError(f"unknown layout {layout!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(cfg, state, layout, dtype, quantize)
    raw = cfg.to_upstream_dict() if layout == "upstream" else cfg.to_transformers_dict()
    raw["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[dtype]
    if quantize:
        raw["quantization_config"] = quantization_config(cfg)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids), "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_shards(out_dir, tensors, shard_bytes)
    return out_dir
