"""Parse a DeepSeek-V4.1 release `config.json` (text geometry under `text_config`,
`quantization_config` beside it) into the engine's `ModelConfig`, with the V4.1-only fields in
`V41Fields`. No torch here: the HTTP process reads configs too.

V4.1 layer kinds: 'swa' (window only, compress ratio 0), 'c2a' (window + the shared ratio-2
compressed KV of its group's source) and 'c1a' (window + the ratio-1 per-token latents of its
source). Only the KV-source layers own a compressor; every other ratio > 0 layer reads the
cache of the nearest source at or below it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .vision.config import RELEASE_IMAGE_TOKEN_ID, VisionConfig, image_token_id_of, parse_vision

# The release omits engram_vocab_size; HF's default reproduces the released table row counts.
RELEASE_ENGRAM_VOCAB_SIZE = 16_000_000
FP4_BLOCK = 32  # routed experts: one E8M0 scale per 32 along K
KINDS = {0: "swa", 2: "c2a", 1: "c1a"}


@dataclass(frozen=True)
class V41Fields:
    """What V4.1 adds to the V4 geometry. Layer ids index the backbone; the DSpark stages are
    `ModelConfig.num_nextn_predict_layers` window-only layers after it."""

    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int
    candidate_topk_blocks: int
    candidate_block_size: int
    gate_temp: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_vocab_size: int
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_id: int
    engram_compressed_vocab_size: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_n_activated_experts: int
    weight_block_size: tuple[int, int] = (32, 32)
    fp4_block_size: int = FP4_BLOCK
    # The vision tower (None: a text-only checkpoint) and the id every image-span position carries.
    vision: VisionConfig | None = None
    image_token_id: int = RELEASE_IMAGE_TOKEN_ID

    def kv_source_of(self, layer: int) -> int:
        """The KV source whose compressed cache (and index keys) ratio > 0 `layer` reads."""
        return max(s for s in self.kv_source_layers if s <= layer)

    @property
    def engram_n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def tail_start(self) -> int:
        """The last KV source: every layer after it writes no global KV (the decoder tail)."""
        return max(self.kv_source_layers)


def _req(t: dict[str, Any], key: str) -> Any:
    from engine.config import ConfigError

    if key not in t:
        raise ConfigError(f"config.json: text_config lacks required key '{key}'")
    return t[key]


def parse_v41(raw: dict[str, Any]):
    """Release root config → ModelConfig(arch='v41'). ConfigError names a bad or missing key."""
    from engine.config import ConfigError, ModelConfig, YarnParams

    t = raw.get("text_config")
    if not isinstance(t, dict):
        raise ConfigError("config.json: deepseek_v41 needs a text_config object")
    q = raw.get("quantization_config") or t.get("quantization_config")
    if q is not None and (q.get("quant_method"), q.get("scale_fmt")) != ("fp8", "ue8m0"):
        raise ConfigError(f"config.json: unsupported V4.1 quantization_config {q}")
    n_layers, n_stages = int(_req(t, "num_hidden_layers")), int(t.get("num_nextn_predict_layers", 0))
    ratios = [int(r) for r in _req(t, "compress_ratios")]
    if len(ratios) != n_layers + n_stages or any(ratios[n_layers:]):
        raise ConfigError("config.json: compress_ratios must cover the layers, then 0 for each DSpark stage")
    if any(r not in KINDS for r in ratios):
        raise ConfigError(f"config.json: V4.1 compress_ratios may hold 0, 1 or 2, got {sorted(set(ratios))}")
    rope = t.get("rope_scaling") or {}
    yarn = None
    if rope.get("rope_type", rope.get("type")) == "yarn":
        yarn = YarnParams(float(rope["factor"]), int(rope["original_max_position_embeddings"]),
                          float(rope.get("beta_fast", 32)), float(rope.get("beta_slow", 1)))
    eos = t.get("eos_token_id", 1)
    fields = V41Fields(
        kv_source_layers=tuple(_req(t, "kv_source_layer_ids")),
        index_source_layers=tuple(_req(t, "index_source_layer_ids")),
        candidate_source_layer=int(t.get("candidate_source_layer_id", -1)),
        candidate_topk_blocks=int(t.get("candidate_topk_blocks", 0)),
        candidate_block_size=int(t.get("candidate_block_size", 1)),
        gate_temp=float(t.get("gate_temp", 1.0)),
        engram_layer_ids=tuple(t.get("engram_layer_ids", ())),
        engram_num_embeddings=tuple(t.get("engram_num_embeddings", ())),
        engram_vocab_size=int(t.get("engram_vocab_size", RELEASE_ENGRAM_VOCAB_SIZE)),
        engram_max_ngram_size=int(t.get("engram_max_ngram_size", 4)),
        engram_n_heads=int(t.get("engram_n_heads", 8)),
        engram_head_dim=int(t.get("engram_head_dim", 256)),
        engram_pad_id=int(t.get("engram_pad_token_id", t.get("pad_token_id", 2))),
        engram_compressed_vocab_size=int(t.get("engram_compressed_vocab_size", 0)),
        dspark_block_size=int(t.get("dspark_block_size", 0)),
        dspark_noise_token_id=int(t.get("dspark_noise_token_id", 0)),
        dspark_target_layer_ids=tuple(t.get("dspark_target_layer_ids", ())),
        dspark_markov_rank=int(t.get("dspark_markov_rank", 0)),
        dspark_n_routed_experts=int(t.get("dspark_n_routed_experts", 0)),
        dspark_n_activated_experts=int(t.get("dspark_num_experts_per_tok", 0)),
        weight_block_size=tuple(int(b) for b in (q or {}).get("weight_block_size", (32, 32))),
        vision=parse_vision(raw),
        image_token_id=image_token_id_of(raw),
    )
    cfg = ModelConfig(
        vocab_size=int(_req(t, "vocab_size")), hidden_size=int(_req(t, "hidden_size")), num_layers=n_layers,
        num_heads=int(_req(t, "num_attention_heads")), head_dim=int(_req(t, "head_dim")),
        rope_dim=int(_req(t, "qk_rope_head_dim")), q_lora_rank=int(_req(t, "q_lora_rank")),
        o_groups=int(_req(t, "o_groups")), o_lora_rank=int(_req(t, "o_lora_rank")),
        sliding_window=int(_req(t, "sliding_window")), compress_ratios=tuple(ratios[:n_layers]),
        layer_kinds=tuple(KINDS[r] for r in ratios[:n_layers]), hash_layers=(False,) * n_layers,
        index_n_heads=int(_req(t, "index_n_heads")), index_head_dim=int(_req(t, "index_head_dim")),
        index_topk=int(_req(t, "index_topk")), n_routed_experts=int(_req(t, "n_routed_experts")),
        n_shared_experts=int(t.get("n_shared_experts", 1)), num_experts_per_tok=int(_req(t, "num_experts_per_tok")),
        moe_intermediate_size=int(_req(t, "moe_intermediate_size")),
        routed_scaling_factor=float(t.get("routed_scaling_factor", 1.5)),
        norm_topk_prob=bool(t.get("norm_topk_prob", True)), scoring_func=str(t.get("scoring_func", "sqrtsoftplus")),
        swiglu_limit=float(t.get("swiglu_limit", 10.0)), hc_mult=int(t.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(t.get("hc_sinkhorn_iters", 20)), hc_eps=float(t.get("hc_eps", 1e-6)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-20)), rope_theta=float(t.get("rope_theta", 10000.0)),
        compress_rope_theta=float(t.get("compress_rope_theta", 160000.0)), yarn=yarn,
        max_position_embeddings=int(t.get("max_position_embeddings", 1048576)), num_nextn_predict_layers=n_stages,
        bos_token_id=t.get("bos_token_id", 0), eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", False)), quantization=q, arch="v41", v41=fields,
    )
    validate_v41(cfg)
    return cfg


def validate_v41(cfg) -> None:
    """The structural rules the forward relies on (ConfigError naming the rule otherwise)."""
    from engine.config import ConfigError

    v, ratios = cfg.v41, cfg.compress_ratios
    layers = range(cfg.num_layers)
    checks = [
        (all(s in layers and ratios[s] for s in v.kv_source_layers), "kv_source_layer_ids must be ratio > 0 layers"),
        (set(v.kv_source_layers) <= set(v.index_source_layers), "every KV source must also be an index source"),
        (all(s in layers and ratios[s] for s in v.index_source_layers), "index sources must be ratio > 0 layers"),
        (all(not r or any(s <= i for s in v.kv_source_layers) for i, r in enumerate(ratios)),
         "every ratio > 0 layer needs a KV source at or below it"),
        (all(not r or ratios[v.kv_source_of(i)] == r for i, r in enumerate(ratios)),
         "a layer's ratio must equal its KV source's"),
        (v.candidate_source_layer < 0 or v.candidate_source_layer in v.index_source_layers,
         "the candidate source must be an index source"),
        (cfg.n_shared_experts == 1 and cfg.scoring_func == "sqrtsoftplus", "V4.1 has one shared expert, sqrtsoftplus"),
        (len(v.engram_num_embeddings) == len(v.engram_layer_ids), "one engram table size per engram layer"),
        (cfg.num_heads % cfg.o_groups == 0, "num_attention_heads must be divisible by o_groups"),
        (all(t in layers for t in v.dspark_target_layer_ids), "dspark_target_layer_ids must be backbone layers"),
        (cfg.head_dim % 32 == 0 and cfg.index_head_dim % 32 == 0, "head dims must be multiples of 32 (QAT blocks)"),
        # REF embeds the image token (and maps it through the Engram token map) before overwriting it
        (v.vision is None or 0 <= v.image_token_id < cfg.vocab_size, "image_token_id must be a vocabulary id"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"config.json: {message}")
