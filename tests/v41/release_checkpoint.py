"""Read a DeepSeek-V4.1 release-format directory for the plain reference forward.

`config.json` is the release root (text geometry under `text_config`, `quantization_config`
beside it); `model.safetensors` holds the release tensor names. Weights are decoded into the
dtype the reference maths reads, so no quantized storage type reaches the model:
  * FP8 e4m3 with one E8M0 scale per 32×32 block (`<name>.scale`) → fp32 (exact), except
    `attn.wo_a`, which REF's convert.py dequantizes to bf16 (exact too) and runs as bf16;
  * FP4 e2m1, two per int8 byte (low nibble = even element), E8M0 per 32 along K → fp32;
  * Engram tables, FP8 with one E8M0 scale per row per 32 → bf16 (REF dequantizes rows to
    bf16 on lookup);
  * BF16 and F32 tensors stay as stored (the model upcasts where REF holds fp32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

# e2m1 code (low three bits magnitude, bit 3 sign) → value.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The release ships no engram_vocab_size; HF's default, checked against the released table rows
# (the sums of the first 24 and next 24 unused primes above it are 384006168 and 384016682).
RELEASE_ENGRAM_VOCAB_SIZE = 16_000_000


@dataclass(frozen=True)
class YarnRope:
    factor: float
    original_max_position: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class V41Config:
    """Every field the V4.1 forward reads. Layer ids index `compress_ratios`, whose entries past
    `n_layers` are the DSpark stages (always 0)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    moe_inter_dim: int
    n_routed_experts: int
    n_activated_experts: int
    n_shared_experts: int
    score_func: str
    gate_temp: float
    norm_topk_prob: bool
    route_scale: float
    swiglu_limit: float
    norm_eps: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnRope | None
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_vocab_size: int
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_id: int
    engram_compressed_vocab_size: int
    n_mtp_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_n_activated_experts: int
    eos_token_id: int
    weight_block_size: tuple[int, int]
    fp4_block_size: int

    def kv_source_of(self, layer: int) -> int:
        """The KV-source layer whose compressed cache a ratio>0 layer reads (the nearest one at
        or below it); its index keys are that source's too."""
        return max(s for s in self.kv_source_layers if s <= layer)

    @property
    def engram_n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def validate(self) -> None:
        ratios = self.compress_ratios
        if len(ratios) != self.n_layers + self.n_mtp_layers or any(ratios[self.n_layers:]):
            raise ValueError("compress_ratios must cover the layers, then 0 for each DSpark stage")
        if not set(self.kv_source_layers) <= set(self.index_source_layers):
            raise ValueError("every KV source must also be an index source (it publishes the keys)")
        for layer in range(self.n_layers):
            if ratios[layer] and ratios[self.kv_source_of(layer)] != ratios[layer]:
                raise ValueError(f"layer {layer}: ratio differs from its KV source's")
        if self.candidate_source_layer not in self.index_source_layers:
            raise ValueError("the candidate source must be an index source")
        if self.n_shared_experts != 1 or self.score_func != "sqrtsoftplus":
            raise ValueError("REF supports one shared expert and sqrtsoftplus routing only")


def _yarn(text: dict) -> YarnRope | None:
    rope = text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) != "yarn":
        return None
    return YarnRope(rope["factor"], rope["original_max_position_embeddings"], rope["beta_fast"], rope["beta_slow"])


def parse_config(root: dict) -> V41Config:
    """Release root config (with `text_config` and `quantization_config`) → V41Config."""
    t, q = root["text_config"], root.get("quantization_config", {})
    if (q.get("quant_method"), q.get("scale_fmt"), q.get("expert_dtype")) != ("fp8", "ue8m0", "fp4"):
        raise ValueError(f"unsupported quantization_config {q}")
    n_layers, n_mtp = t["num_hidden_layers"], t.get("num_nextn_predict_layers", 0)
    cfg = V41Config(
        vocab_size=t["vocab_size"], dim=t["hidden_size"], n_layers=n_layers, n_heads=t["num_attention_heads"],
        head_dim=t["head_dim"], rope_dim=t["qk_rope_head_dim"], q_lora_rank=t["q_lora_rank"],
        o_groups=t["o_groups"], o_lora_rank=t["o_lora_rank"], window=t["sliding_window"],
        compress_ratios=tuple(t["compress_ratios"]), kv_source_layers=tuple(t["kv_source_layer_ids"]),
        index_source_layers=tuple(t["index_source_layer_ids"]),
        candidate_source_layer=t["candidate_source_layer_id"], candidate_topk_blocks=t["candidate_topk_blocks"],
        candidate_block_size=t["candidate_block_size"], index_n_heads=t["index_n_heads"],
        index_head_dim=t["index_head_dim"], index_topk=t["index_topk"], moe_inter_dim=t["moe_intermediate_size"],
        n_routed_experts=t["n_routed_experts"], n_activated_experts=t["num_experts_per_tok"],
        n_shared_experts=t["n_shared_experts"], score_func=t["scoring_func"], gate_temp=t.get("gate_temp", 1.0),
        norm_topk_prob=t["norm_topk_prob"], route_scale=t["routed_scaling_factor"],
        swiglu_limit=t["swiglu_limit"], norm_eps=t["rms_norm_eps"], hc_mult=t["hc_mult"],
        hc_sinkhorn_iters=t["hc_sinkhorn_iters"], hc_eps=t["hc_eps"], rope_theta=t["rope_theta"],
        compress_rope_theta=t["compress_rope_theta"], yarn=_yarn(t),
        engram_layer_ids=tuple(t["engram_layer_ids"]), engram_num_embeddings=tuple(t["engram_num_embeddings"]),
        engram_vocab_size=t.get("engram_vocab_size", RELEASE_ENGRAM_VOCAB_SIZE),
        engram_max_ngram_size=t["engram_max_ngram_size"], engram_n_heads=t["engram_n_heads"],
        engram_head_dim=t["engram_head_dim"], engram_pad_id=t["engram_pad_token_id"],
        engram_compressed_vocab_size=t["engram_compressed_vocab_size"], n_mtp_layers=n_mtp,
        dspark_block_size=t["dspark_block_size"], dspark_noise_token_id=t["dspark_noise_token_id"],
        dspark_target_layer_ids=tuple(t["dspark_target_layer_ids"]), dspark_markov_rank=t["dspark_markov_rank"],
        dspark_n_routed_experts=t["dspark_n_routed_experts"],
        dspark_n_activated_experts=t["dspark_num_experts_per_tok"], eos_token_id=t["eos_token_id"],
        weight_block_size=tuple(q.get("weight_block_size", (32, 32))), fp4_block_size=32,
    )
    cfg.validate()
    return cfg


def load_config(model_dir: Path) -> V41Config:
    return parse_config(json.loads((Path(model_dir) / "config.json").read_text()))


# ---- weight decoding ----------------------------------------------------------------------


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes → fp32 2^(byte - 127); byte 0xFF is NaN."""
    b = scale.view(torch.uint8).to(torch.int32)
    value = torch.ldexp(torch.ones(b.shape), b - 127)
    return torch.where(b == 255, float("nan"), value)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3fn bytes → fp32: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is
    subnormal (m · 2^-9); S.1111.111 is NaN; there is no infinity."""
    b = codes.view(torch.uint8).to(torch.int32)
    sign = torch.where(b >= 128, -1.0, 1.0)
    exponent, mantissa = (b >> 3) & 0xF, (b & 0x7).float()
    normal = torch.ldexp(1.0 + mantissa / 8, exponent - 7)
    value = sign * torch.where(exponent == 0, torch.ldexp(mantissa, torch.tensor(-9)), normal)
    return torch.where((b & 0x7F) == 0x7F, float("nan"), value)


def _expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """[ceil(O/bo), ceil(I/bi)] block scales → [O, I] per element."""
    return scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def decode_fp8_blocked(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 [O, I] with E8M0 block scales → fp32 [O, I] (exact: at most 4 significant bits)."""
    return decode_e4m3(weight) * _expand_blocks(decode_e8m0(scale), block, weight.shape)


def decode_fp4_packed(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """int8 [O, I/2] holding two e2m1 codes per byte (low nibble = even element), E8M0 per
    `block` along I [O, I/block] → fp32 [O, I]."""
    b = weight.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)  # [O, I]
    values = torch.tensor(E2M1_VALUES)[codes]
    return values * decode_e8m0(scale).repeat_interleave(block, 1)


@dataclass(frozen=True)
class ReleaseCheckpoint:
    config: V41Config
    weights: dict[str, torch.Tensor]  # release names, scales folded in, decoded dtypes
    model_dir: Path


def _decode(name: str, weight: torch.Tensor, scale: torch.Tensor, cfg: V41Config) -> torch.Tensor:
    if weight.dtype == torch.int8:
        return decode_fp4_packed(weight, scale, cfg.fp4_block_size)
    if name.endswith("engram.embed.weight"):  # one scale per row per 32
        return decode_fp8_blocked(weight, scale, (1, cfg.fp4_block_size)).to(torch.bfloat16)
    dense = decode_fp8_blocked(weight, scale, cfg.weight_block_size)
    # convert.py dequantizes wo_a (a block-diagonal einsum, not a GEMM) to bf16
    return dense.to(torch.bfloat16) if name.endswith("attn.wo_a.weight") else dense


def load_weights(model_dir: Path, cfg: V41Config) -> dict[str, torch.Tensor]:
    """model.safetensors → {name: decoded tensor}; every `.scale` is consumed by its weight."""
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for name, tensor in raw.items():
        if name.endswith(".scale"):
            if name[: -len(".scale")] + ".weight" not in raw:
                raise ValueError(f"{name}: scale without a weight")
            continue
        scale = raw.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if scale is not None:
            out[name] = _decode(name, tensor, scale, cfg)
        elif tensor.dtype in (torch.bfloat16, torch.float32):
            # A copy in its own (64-byte aligned) allocation, as REF holds its parameters: a
            # tensor read from the file sits at the file's offset, and MKL's fp32 GEMM rounds
            # differently for unaligned operands on some CPUs (seen on an AMD EPYC: the mHC
            # projection's last bits, hence c2 prompt 2's tokens from step 14 on)
            out[name] = tensor.clone()
        else:
            raise ValueError(f"{name}: {tensor.dtype} without a scale")
    return out


def load_release_checkpoint(model_dir: Path) -> ReleaseCheckpoint:
    cfg = load_config(model_dir)
    return ReleaseCheckpoint(cfg, load_weights(model_dir, cfg), Path(model_dir))
