"""Random-weight DeepSeek-V4.1 checkpoints in the release format (`make-model --arch v41`).

The config is the release's root `config.json` (text geometry under `text_config`,
`quantization_config` beside it); tensors carry the release names. With `quantize="fp8-fp4"`
the storage is the release's: FP8 e4m3 with E8M0 32×32 block scales for the projections,
shared experts, indexer wq_b, Engram wkv and DSpark main_proj (attn.wo_a too); routed experts
FP4 e2m1 two per byte (low nibble = even element) with E8M0 per 32 along K; Engram tables FP8
with one E8M0 scale per row per 32; BF16 / F32 the rest. Without it the same tensors are BF16.

Weights are drawn from (seed, tensor name) and scaled so activations stay O(1): dense
N(0, 1)·fan_in^-½, residual-writing projections (wo_b, w2) ×0.1, the head ×4, norms 1 + 0.1·N,
mHC fn N·(hc·dim)^-½, base 0.5·N (+1 on the comb diagonal), scale U(0.5, 1).

`vision=True` adds a vision tower (`VISION_PRESETS`, the release's tensor names and BF16
storage: `vision.*`, `aligner.*`, the span vectors, an F32 `gate.bias_vl` in every Gate) and the
image token `<｜deepseek_image｜>` as the tokenizer's last id (the vocabulary grows by one):
matrices N(0, 1)·fan_in^-½, biases 0.02·N, norms 1 + 0.1·N, span vectors N(0, 0.5),
`bias_vl` 0.5·N (larger than the text bias, so image routing really differs).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import e2m1_codes, write_shards
from ..config import ModelConfig
from .engram import table_rows
from .vision.config import IMAGE_PLACEHOLDER, VisionConfig, vision_to_release
from .vision.encoder import release_name
from .weight_names import v41_export_names

# Vision towers for `vision=True`, per preset: every feature at toy sizes (a stretch ratio, an
# upscale floor and a token budget that shrinks photos), and a ViT of the release's patch / ratio.
VISION_PRESETS: dict[str, VisionConfig] = {
    "tiny": VisionConfig(n_layers=2, dim=32, n_heads=2, inter_dim=64, patch_size=8, rope_theta=10000.0,
                         downsample_ratio=2, max_n_token=48, min_pixels=1200, max_wh_ratio=4.0),
    "small": VisionConfig(n_layers=4, dim=128, n_heads=4, inter_dim=256, patch_size=14, rope_theta=10000.0,
                          downsample_ratio=3, max_n_token=256, min_pixels=196 * 196, max_wh_ratio=None),
}

_TEXT_BASE: dict[str, Any] = {
    "model_type": "deepseek_v41_text", "num_key_value_heads": 1, "hidden_act": "silu",
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "n_shared_experts": 1, "rms_norm_eps": 1e-20,
    "hc_eps": 1e-6, "hc_mult": 4, "hc_sinkhorn_iters": 20, "rope_theta": 10000, "compress_rope_theta": 160000,
    "gate_temp": 1.0, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "engram_pad_token_id": 2,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 3, "max_position_embeddings": 1048576,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
}

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds per test: every V4.1 feature at toy sizes (two KV groups, a candidate source with a
    # later level-two source, a decoder tail, Engram on two layers, three DSpark stages).
    "tiny": {
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "head_dim": 64,
        "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8,
        "compress_ratios": [0, 0, 2, 2, 1, 1, 0, 0, 0], "kv_source_layer_ids": [2, 4],
        "index_source_layer_ids": [2, 4, 5], "candidate_source_layer_id": 4, "candidate_topk_blocks": 3,
        "candidate_block_size": 4, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 6,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "engram_layer_ids": [1, 2], "engram_vocab_size": 40, "engram_max_ngram_size": 3, "engram_n_heads": 2,
        "engram_head_dim": 32, "dspark_block_size": 4, "dspark_noise_token_id": 511,
        "dspark_target_layer_ids": [3, 4, 5], "dspark_markov_rank": 16, "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    },
    # The benchmark model: the released attention geometry (head_dim 512, window 128, index
    # 32 × 128 top-512, candidate blocks of 8) at a small width, 12 layers of which the 5 after
    # the last KV source form the decoder tail.
    "small": {
        "vocab_size": 8192, "hidden_size": 256, "num_hidden_layers": 12, "num_attention_heads": 16, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 256, "o_groups": 4, "o_lora_rank": 256, "sliding_window": 128,
        "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0], "kv_source_layer_ids": [2, 4, 6],
        "index_source_layer_ids": [2, 4, 6, 8, 10], "candidate_source_layer_id": 6, "candidate_topk_blocks": 256,
        "candidate_block_size": 8, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "moe_intermediate_size": 128, "n_routed_experts": 32, "num_experts_per_tok": 4,
        "engram_layer_ids": [1, 4], "engram_vocab_size": 1000, "engram_max_ngram_size": 4, "engram_n_heads": 4,
        "engram_head_dim": 64, "dspark_block_size": 5, "dspark_noise_token_id": 8191,
        "dspark_target_layer_ids": [9, 10, 11], "dspark_markov_rank": 64, "dspark_n_routed_experts": 8,
        "dspark_num_experts_per_tok": 2,
    },
}

# Tensors REF keeps (or promotes) out of FP8: bf16 / fp32 by the release's rules.
F32_SUFFIXES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                "attn_sink", "gate.bias", "gate.bias_vl")


def release_config(preset: str, compressed_vocab_size: int, quantize: str | None,
                   vision: VisionConfig | None = None, image_token_id: int | None = None, **overrides: Any) -> dict:
    """The root config.json of a preset (engram table sizes from its primes); `vision`: the
    tower (None: text only, `vision_config` with zero layers as the text-only release)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown V4.1 preset {preset!r}; choose one of {sorted(PRESETS)}")
    text = {**_TEXT_BASE, **PRESETS[preset], **overrides}
    text["engram_compressed_vocab_size"] = compressed_vocab_size
    text["engram_num_embeddings"] = table_rows(len(text["engram_layer_ids"]), text["engram_max_ngram_size"],
                                               text["engram_n_heads"], text["engram_vocab_size"])
    tower = vision_to_release(vision) if vision is not None else {"model_type": "deepseek_v41_vision",
                                                                   "num_hidden_layers": 0}
    root = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
            "tie_word_embeddings": False, "text_config": text, "vision_config": tower}
    if image_token_id is not None:
        root["image_token_id"] = image_token_id
    if quantize:
        root["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                       "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    return root


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"v41:{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _draw(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    g = _generator(seed, name)
    randn = lambda s: torch.randn(shape, generator=g) * s  # noqa: E731
    leaf = name.rpartition(".")[2]
    if release_name(name) is not None:
        return _draw_vision(release_name(name), shape, randn)
    if name.endswith("gate.bias_vl"):
        return randn(0.5)
    if name.endswith(("norm.weight", "q_weight", "k_weight")):
        return 1.0 + randn(0.1)
    if leaf.endswith("_scale"):
        return 0.5 + 0.5 * torch.rand(shape, generator=g)
    if leaf.endswith("_base"):
        base = randn(0.5)
        n = cfg.hc_mult
        base[2 * n:] += torch.eye(n).flatten()  # comb starts near the identity
        return base
    if leaf.endswith("_fn"):
        return randn((cfg.hc_mult * cfg.hidden_size) ** -0.5)
    if leaf == "attn_sink":
        return randn(1.0)
    if name.endswith("gate.bias"):
        return randn(0.2)
    if name in ("embed.weight",) or "markov_head.embed" in name:
        return randn(0.5)
    if name.endswith("engram.embed.weight"):
        return randn(1.0)
    scale = 1.0 / math.sqrt(shape[-1])
    if ".wo_b." in name or name.endswith("w2.weight"):
        scale *= 0.1
    if name == "head.weight":
        scale *= 4.0
    return randn(scale)


def _draw_vision(name: str, shape: tuple[int, ...], randn) -> torch.Tensor:
    if name.startswith("image_"):  # the span vectors
        return randn(0.5)
    if name.endswith("bias"):
        return randn(0.02)
    if name.rsplit(".", 2)[-2].startswith("norm"):  # norm1, norm2, the final norm
        return 1.0 + randn(0.1)
    return randn(shape[-1] ** -0.5)


def random_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Internal parameter name (dense model with DSpark, every expert) → fp32 tensor."""
    from .weights import build_v41

    model = build_v41(cfg, with_dspark=cfg.num_nextn_predict_layers > 0)
    return {name: _draw(name, tuple(p.shape), cfg, seed) for name, p in model.named_parameters()}


# ---- release storage -----------------------------------------------------------------------------


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(torch.float8_e8m0fnu)


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    ratio = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return torch.exp2(torch.ceil(torch.log2(ratio)))


def fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, C] → (e4m3 [R, C], E8M0 [ceil(R/bR), ceil(C/bC)]), ragged edge blocks included."""
    r, c = w.shape
    br, bc = block
    padded = torch.zeros(-(-r // br) * br, -(-c // bc) * bc, device=w.device)
    padded[:r, :c] = w
    tiles = padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    scale = _pow2_scale(tiles.abs().amax(dim=(1, 3)), 448.0)  # [R/bR, C/bC]
    q = (tiles / scale[:, None, :, None]).view(padded.shape)[:r, :c].to(torch.float8_e4m3fn)
    return q, _e8m0(scale)


def fp4_rows(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, C] → (int8 [R, C/2] e2m1 pairs, low nibble = even column; E8M0 [R, C/group])."""
    r, c = w.shape
    groups = w.view(r, c // group, group)
    scale = _pow2_scale(groups.abs().amax(dim=-1), 6.0)
    codes = e2m1_codes((groups / scale[..., None]).clamp(-6, 6)).view(r, c)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8), _e8m0(scale)


def fp8_stored(name: str) -> bool:
    """Tensors the release stores FP8 (every projection outside the compressor / indexer keys)."""
    if not name.endswith(".weight") or "experts." in name and "shared_experts" not in name:
        return False
    fp8 = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".indexer.wq_b.",
           ".shared_experts.", ".engram.wkv.", ".main_proj.")
    return any(part in name for part in fp8)


def export_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor], quantize: str | None) -> dict[str, torch.Tensor]:
    """Release name → stored tensor."""
    if quantize not in (None, "fp8-fp4"):
        raise ValueError(f"unknown quantization {quantize!r}")
    inter, out = cfg.moe_intermediate_size, {}
    for internal, value in state.items():
        if release_name(internal) is not None:  # the vision tower: BF16 throughout, as released
            out[release_name(internal)] = value.to(torch.bfloat16).contiguous()
            continue
        for name, expert, part in v41_export_names(internal, value.shape[0] if ".experts." in internal else 0):
            if expert is not None:
                rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "all": slice(None)}[part]
                piece = value[expert, rows].contiguous()
                if quantize:
                    out[name], out[name.removesuffix(".weight") + ".scale"] = fp4_rows(piece)
                else:
                    out[name] = piece.to(torch.bfloat16)
            elif quantize and name.endswith("engram.embed.weight"):
                out[name], out[name.removesuffix(".weight") + ".scale"] = fp8_blocks(value, (1, 32))
            elif quantize and fp8_stored(name):
                out[name], out[name.removesuffix(".weight") + ".scale"] = fp8_blocks(value, (32, 32))
            elif name.endswith(F32_SUFFIXES):
                out[name] = value.float().contiguous()
            else:
                out[name] = value.to(torch.bfloat16).contiguous()
    return out


def write_v41_checkpoint(out_dir: str | Path, preset: str, seed: int = 0, quantize: str | None = None,
                         vision: bool | VisionConfig = False, **overrides: Any) -> Path:
    """config.json, generation_config.json, tokenizer, engram_token_map.json and the tensors.
    `vision`: True for the preset's tower (VISION_PRESETS), or a VisionConfig."""
    from tokenization.synthetic_bpe import write_tokenizer

    from .engram import build_token_map, write_token_map

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {**PRESETS.get(preset, {}), **overrides}.get("vocab_size", 512)
    write_tokenizer(out_dir, vocab)
    tower = (VISION_PRESETS.get(preset) if vision is True else vision) or None
    if vision is True and tower is None:
        raise ValueError(f"no vision tower for preset {preset!r}; choose one of {sorted(VISION_PRESETS)}")
    image_token_id = None
    if tower is not None:
        image_token_id = _add_image_token(out_dir / "tokenizer.json")
        overrides = {**overrides, "vocab_size": image_token_id + 1}
    token_map, size = build_token_map(out_dir / "tokenizer.json")
    write_token_map(out_dir, token_map, size)
    root = release_config(preset, size, quantize, tower, image_token_id, **overrides)
    (out_dir / "config.json").write_text(json.dumps(root, indent=2) + "\n")
    cfg = ModelConfig.from_model_dir(out_dir)
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids), "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_shards(out_dir, export_tensors(cfg, random_state(cfg, seed), quantize), 512 * 2**20)
    return out_dir


def _add_image_token(tokenizer_json: Path) -> int:
    """Append `<｜deepseek_image｜>` to a tokenizer as a special token; its id (the last)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.add_special_tokens([AddedToken(IMAGE_PLACEHOLDER, special=True, normalized=False)])
    tok.save(str(tokenizer_json))
    return tok.token_to_id(IMAGE_PLACEHOLDER)
