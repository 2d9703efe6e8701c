"""A small DeepSeek-V4.1 with its DSpark stages: geometry, training losses, balancing, export.

The model is train/v41_model.py's backbone and train/v41_dspark.py's drafter over one set of
fp32 masters (`V41Params`, named as the engine names its parameters). `export_checkpoint`
writes a release-format directory (root config.json with text_config and quantization_config,
tensors under the release names in the release's storage: FP8 e4m3 with E8M0 32×32 scales,
FP4 routed experts, FP8 Engram tables, BF16 / F32 the rest; engram_token_map.json) that
`engine.weights.load_model` loads with no flag. The trained values are the storage's values
already (QAT), so the export is lossless.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.v41.checkpoint import export_tensors, release_config
from engine.v41.config import parse_v41
from engine.v41.engram import EngramHasher, build_token_map, write_token_map

from . import v41_dspark, v41_model
from .v41_model import V41Params, effective_weights

QUANTIZE = "fp8-fp4"
NOISE_TOKEN_ID = 2  # the pad token: never in the training text, so it says only "unknown here"

# Layer pattern of the engine's `tiny` V4.1 preset: two window-only layers, a ratio-2 KV group
# (source 2, candidate blocks off) and a ratio-1 group (source 4 = candidate source, 5 = level
# two), Engram on layers 1 and 2, DSpark reading layers 3–5, three DSpark stages.
_LAYERS: dict[str, Any] = {
    "num_hidden_layers": 6, "compress_ratios": [0, 0, 2, 2, 1, 1, 0, 0, 0], "kv_source_layer_ids": [2, 4],
    "index_source_layer_ids": [2, 4, 5], "candidate_source_layer_id": 4, "engram_layer_ids": [1, 2],
    "dspark_target_layer_ids": [3, 4, 5], "num_nextn_predict_layers": 3, "dspark_noise_token_id": NOISE_TOKEN_ID,
    "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32,
}

GEOMETRIES: dict[str, dict[str, Any]] = {
    # The recipe's small V4.1: 256-token windows use the window (32), both compressed branches
    # with a real top-16 choice, and the two-level candidate blocks.
    "builtin": {
        **_LAYERS, "hidden_size": 128, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32, "sliding_window": 32, "index_n_heads": 4,
        "index_head_dim": 32, "index_topk": 16, "candidate_topk_blocks": 8, "candidate_block_size": 4,
        "moe_intermediate_size": 64, "n_routed_experts": 8, "num_experts_per_tok": 2, "engram_vocab_size": 1000,
        "dspark_block_size": 4, "dspark_markov_rank": 32, "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
    },
    # The test's: the engine's tiny preset sizes (window 8, top-6 of up to 16 entries, candidate
    # blocks of 4) on 32-token windows, so selection, candidates and ring-order windows all act.
    "tiny": {
        **_LAYERS, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8, "index_n_heads": 4,
        "index_head_dim": 32, "index_topk": 6, "candidate_topk_blocks": 3, "candidate_block_size": 4,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "engram_vocab_size": 40,
        "dspark_block_size": 4, "dspark_markov_rank": 16, "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
    },
}


@dataclass
class Geometry:
    root: dict  # the release root config.json
    cfg: ModelConfig  # parsed, arch 'v41'
    token_map: list[int]
    compressed_size: int


def geometry(name: str, tokenizer_json: Path) -> Geometry:
    """The release config of a named geometry for a tokenizer (its vocabulary and Engram map)."""
    if name not in GEOMETRIES:
        raise ValueError(f"unknown V4.1 geometry {name!r}; choose one of {sorted(GEOMETRIES)}")
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    token_map, size = build_token_map(tokenizer_json)
    root = release_config("tiny", size, QUANTIZE, **GEOMETRIES[name], vocab_size=vocab)
    return Geometry(root, parse_v41(root), token_map, size)


@dataclass
class Model:
    """The trainable V4.1: masters plus what a forward needs besides them."""

    geo: Geometry
    params: V41Params
    hasher: EngramHasher | None

    @property
    def cfg(self) -> ModelConfig:
        return self.geo.cfg


def build(geo: Geometry, seed: int, device: torch.device | str = "cpu") -> Model:
    """Fresh masters (the release writer's random draw for (seed, name), made on the host, so
    the same on every device) on `device`, and the Engram hasher (host: it hashes as the engine)."""
    hasher = EngramHasher(geo.cfg, geo.token_map) if geo.cfg.v41.engram_layer_ids else None
    return Model(geo, V41Params(geo.cfg, seed).to(device), hasher)


@dataclass
class Losses:
    lm: torch.Tensor  # mean next-token cross entropy (nats)
    dspark: torch.Tensor  # mean DSpark block cross entropy
    confidence: torch.Tensor  # the confidence head's BCE
    kl: torch.Tensor  # mean indexer KL over the index sources
    dspark_accuracy: torch.Tensor  # [block] teacher-forced top-1 accuracy per draft position
    router_picks: list  # (MoE prefix, [N, k] experts) of this forward


def losses(model: Model, window: torch.Tensor, anchors: int, gen: torch.Generator | None = None,
           exact: bool = True) -> Losses:
    """window [B, L+1]: the backbone on window[:, :L], its next-token loss, DSpark's block loss
    on `anchors` anchors per sequence (0: all), the indexers' KL. Runs on the masters' device."""
    w = effective_weights(model.params)
    window = window.to(w["embed.weight"].device)
    out = v41_model.forward(model.cfg, w, model.hasher, window[:, :-1], exact)
    vocab = out.logits.shape[-1]
    lm = F.cross_entropy(out.logits.reshape(-1, vocab), window[:, 1:].reshape(-1))
    ds = v41_dspark.losses(out.ctx, out.main_hidden, window, anchors, gen)
    kls = [v41_model.indexer_kl(r) for _, r in sorted(out.ctx.index.items())]
    kl = torch.stack(kls).mean() if kls else lm * 0.0
    return Losses(lm, ds.ce, ds.confidence, kl, ds.per_position, out.ctx.router_picks)


@torch.no_grad()
def update_router_bias(model: Model, picks: list, rate: float) -> None:
    """Aux-loss-free balancing: each router's selection bias moves towards even load."""
    for prefix, experts in picks:
        bias = model.params.get_parameter(f"{prefix}.gate.bias")
        load = torch.bincount(experts.reshape(-1), minlength=bias.shape[0]).float()
        bias += rate * torch.sign(load.mean() - load)


def indexer_parameters(model: Model) -> list[torch.nn.Parameter]:
    return [p for name, p in model.params.named_parameters() if ".indexer." in name]


def export_checkpoint(out_dir: Path, model: Model) -> Path:
    """config.json, generation_config.json, engram_token_map.json and model.safetensors (release
    names and storage) in out_dir; the tokenizer files are the recipe's."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        state = {name: t.detach().cpu() for name, t in effective_weights(model.params).items()}
    tensors = export_tensors(model.cfg, state, QUANTIZE)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(model.geo.root, indent=2) + "\n")
    gen = {"bos_token_id": model.cfg.bos_token_id, "eos_token_id": list(model.cfg.eos_token_ids), "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_token_map(out_dir, model.geo.token_map, model.geo.compressed_size)
    return out_dir
