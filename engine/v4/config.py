"""DeepSeek-V4's config.json → `ModelConfig` (engine/config.py); `ConfigError` names a bad key.

Both config dialects of DeepSeek-V4 are accepted:
  * the transformers dialect (`layer_types`, `compress_rates`, `mlp_layer_types`,
    nested `rope_parameters` with `main` / `compress`), and
  * the upstream dialect shipped with released checkpoints (`compress_ratios` per layer,
    `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`).
Everything the engine needs is normalised into `ModelConfig`; derived values are its properties.
No torch here.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import LAYER_TYPE_TO_KIND, ConfigError, ModelConfig, YarnParams


def _require(raw: dict[str, Any], key: str, kind: type | tuple[type, ...] = (int, float)) -> Any:
    if key not in raw:
        raise ConfigError(f"config.json: missing required key '{key}'")
    value = raw[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"config.json: '{key}' has the wrong type ({type(value).__name__})")
    return value


def parse_v4(raw: dict[str, Any]) -> ModelConfig:
    """A DeepSeek-V4 config.json (either dialect) → ModelConfig; ConfigError names a bad key."""
    if "text_config" in raw:
        raise ConfigError("config.json: composite (text_config) configs are not supported for deepseek_v4")
    num_layers = int(_require(raw, "num_hidden_layers", int))
    head_dim = int(raw.get("head_dim", 512))
    rope_dim = _rope_dim(raw, head_dim)
    kinds, ratios = _compress_ratios(raw, num_layers)
    hash_layers = _hash_layers(raw, num_layers)
    yarn, compress_theta = _compress_rope(raw)
    eos = raw.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    main_theta = raw.get("rope_theta", 10000.0)
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict):
        main_theta = rp["main"].get("rope_theta", main_theta)
    cfg = ModelConfig(
        vocab_size=int(_require(raw, "vocab_size", int)),
        hidden_size=int(_require(raw, "hidden_size", int)),
        num_layers=num_layers,
        num_heads=int(_require(raw, "num_attention_heads", int)),
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=int(raw.get("q_lora_rank", 1024)),
        o_groups=int(raw.get("o_groups", 8)),
        o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        sliding_window=int(raw.get("sliding_window", 128)),
        compress_ratios=ratios,
        layer_kinds=kinds,
        hash_layers=hash_layers,
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        n_routed_experts=int(raw.get("n_routed_experts", 256)),
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 6)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 2048)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(main_theta),
        compress_rope_theta=float(compress_theta),
        yarn=yarn,
        max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0)),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=eos_ids,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        quantization=raw.get("quantization_config"),
    )
    _validate(cfg)
    return cfg


def _rope_dim(raw: dict[str, Any], head_dim: int) -> int:
    if "qk_rope_head_dim" in raw:
        return int(raw["qk_rope_head_dim"])
    factor = raw.get("partial_rotary_factor")
    rp = raw.get("rope_parameters")
    if factor is None and isinstance(rp, dict) and isinstance(rp.get("main"), dict):
        factor = rp["main"].get("partial_rotary_factor")
    return int(head_dim * (factor if factor is not None else 64 / 512))


def _compress_ratios(raw: dict[str, Any], num_layers: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    rates = dict(raw.get("compress_rates") or {})
    csa = int(raw.get("compress_rate_csa", rates.get("compressed_sparse_attention", 4)))
    hca = int(raw.get("compress_rate_hca", rates.get("heavily_compressed_attention", 128)))
    if raw.get("layer_types") is not None:
        types = list(raw["layer_types"])[:num_layers]
        bad = [t for t in types if t not in LAYER_TYPE_TO_KIND]
        if bad:
            raise ConfigError(f"config.json: unknown layer_types entries {bad}")
        kinds = [LAYER_TYPE_TO_KIND[t] for t in types]
    elif raw.get("compress_ratios") is not None:
        legacy = list(raw["compress_ratios"])[:num_layers]
        remap = {0: "swa", 4: "csa", 128: "hca"}
        if any(r not in remap for r in legacy):
            raise ConfigError(f"config.json: compress_ratios may only hold 0, 4 or 128, got {sorted(set(legacy))}")
        kinds = [remap[r] for r in legacy]
    else:
        # transformers' default schedule: 2 HCA bootstrap layers, then CSA/HCA interleaved.
        kinds = ["hca"] * min(num_layers, 2) + ["csa" if i % 2 else "hca" for i in range(max(num_layers - 2, 0))]
    if len(kinds) != num_layers:
        raise ConfigError(f"config.json: {len(kinds)} per-layer attention types for {num_layers} layers")
    by_kind = {"swa": 0, "csa": csa, "hca": hca}
    return tuple(kinds), tuple(by_kind[k] for k in kinds)


def _hash_layers(raw: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = list(raw["mlp_layer_types"])[:num_layers]
        if any(t not in ("hash_moe", "moe") for t in types):
            raise ConfigError(f"config.json: unknown mlp_layer_types entries {sorted(set(types))}")
        return tuple(t == "hash_moe" for t in types)
    n_hash = int(raw.get("num_hash_layers", 3))
    return tuple(i < n_hash for i in range(num_layers))


def _compress_rope(raw: dict[str, Any]) -> tuple[YarnParams | None, float]:
    theta = raw.get("compress_rope_theta", 160000.0)
    rp = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        scaling = rp["compress"]
        theta = scaling.get("rope_theta", theta)
    elif isinstance(rp, dict) and rp.get("rope_type", rp.get("type")) == "yarn":
        scaling = rp
    if not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return None, theta
    if scaling.get("attention_factor", 1.0) != 1.0:
        raise ConfigError("config.json: DeepSeek-V4 compress rope must have attention_factor 1.0")
    try:
        yarn = YarnParams(
            factor=float(scaling["factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast") or 32.0),
            beta_slow=float(scaling.get("beta_slow") or 1.0),
        )
    except KeyError as exc:
        raise ConfigError(f"config.json: yarn rope scaling lacks {exc.args[0]!r}") from None
    return yarn, theta


def _validate(cfg: ModelConfig) -> None:
    checks = [
        (cfg.rope_dim % 2 == 0 and 0 < cfg.rope_dim <= cfg.head_dim, "qk_rope_head_dim must be even and ≤ head_dim"),
        (cfg.index_head_dim >= cfg.rope_dim, "index_head_dim must be ≥ qk_rope_head_dim"),
        (cfg.num_heads % cfg.o_groups == 0, "num_attention_heads must be divisible by o_groups"),
        (cfg.num_experts_per_tok <= cfg.n_routed_experts, "num_experts_per_tok exceeds n_routed_experts"),
        (cfg.scoring_func == "sqrtsoftplus", f"scoring_func {cfg.scoring_func!r} is not supported (sqrtsoftplus)"),
        (cfg.sliding_window >= 1, "sliding_window must be ≥ 1"),
        (cfg.csa_ratio >= 1 and cfg.hca_ratio >= 1, "compress rates must be ≥ 1"),
        (cfg.n_shared_experts in (0, 1), "n_shared_experts must be 0 or 1"),
        (cfg.hc_mult >= 1, "hc_mult must be ≥ 1"),
        (all(r >= 0 for r in cfg.compress_ratios), "compress ratios must be ≥ 0"),
        (math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0, "rms_norm_eps must be positive"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"config.json: {message}")
