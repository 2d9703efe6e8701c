"""Release-format reading: FP8 / E8M0 / packed FP4 decoding and the config's field mapping."""

from __future__ import annotations

import json

import pytest
import torch

from tests.v41.release_checkpoint import (decode_e4m3, decode_e8m0, decode_fp4_packed, decode_fp8_blocked,
                                          load_release_checkpoint, parse_config)


def test_e4m3_and_e8m0_decoders_match_torch():
    b = torch.arange(256, dtype=torch.uint8)
    for mine, ref in ((decode_e4m3(b), b.view(torch.float8_e4m3fn).float()),
                      (decode_e8m0(b), b.view(torch.float8_e8m0fnu).float())):
        both_nan = torch.isnan(mine) & torch.isnan(ref)
        assert torch.equal(mine[~both_nan], ref[~both_nan]) and torch.equal(torch.isnan(mine), torch.isnan(ref))


def test_fp4_low_nibble_is_the_even_element():
    # byte 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0) second; 0x9F: low F (-6), high 9 (-0.5)
    w = torch.tensor([[0x21, 0x9F - 256]], dtype=torch.int8)
    scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^(128-127) = 2
    assert decode_fp4_packed(w, scale, block=4).tolist() == [[1.0, 2.0, -12.0, -1.0]]


def test_fp8_block_scales_cover_ragged_edges():
    w = torch.ones(40, 33).to(torch.float8_e4m3fn)
    scale = torch.tensor([[127, 128], [126, 130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    out = decode_fp8_blocked(w, scale, (32, 32))
    assert out[:32, :32].eq(1).all() and out[:32, 32:].eq(2).all()
    assert out[32:, :32].eq(0.5).all() and out[32:, 32:].eq(8).all()


@pytest.mark.parametrize("name", ["c1", "c2"])
def test_config_matches_refs_flat_model_args(golden_root, name):
    """The release-format parse must agree with REF's own flat ModelArgs (inference/config.json)."""
    cfg = parse_config(json.loads((golden_root / name / "config.json").read_text()))
    flat = json.loads((golden_root / name / "inference" / "config.json").read_text())
    pairs = {"dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "head_dim": cfg.head_dim,
             "rope_head_dim": cfg.rope_dim, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
             "o_lora_rank": cfg.o_lora_rank, "window_size": cfg.window, "compress_ratios": list(cfg.compress_ratios),
             "kv_source_layers": list(cfg.kv_source_layers), "index_source_layers": list(cfg.index_source_layers),
             "candidate_source_layer": cfg.candidate_source_layer, "candidate_topk_blocks": cfg.candidate_topk_blocks,
             "candidate_block_size": cfg.candidate_block_size, "index_n_heads": cfg.index_n_heads,
             "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk, "moe_inter_dim": cfg.moe_inter_dim,
             "n_routed_experts": cfg.n_routed_experts, "n_activated_experts": cfg.n_activated_experts,
             "gate_temp": cfg.gate_temp, "route_scale": cfg.route_scale, "swiglu_limit": cfg.swiglu_limit,
             "norm_eps": cfg.norm_eps, "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
             "hc_eps": cfg.hc_eps, "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.compress_rope_theta,
             "original_seq_len": cfg.yarn.original_max_position, "rope_factor": cfg.yarn.factor,
             "beta_fast": cfg.yarn.beta_fast, "beta_slow": cfg.yarn.beta_slow,
             "engram_layer_ids": list(cfg.engram_layer_ids), "engram_num_embeddings": list(cfg.engram_num_embeddings),
             "engram_vocab_size": cfg.engram_vocab_size, "engram_max_ngram_size": cfg.engram_max_ngram_size,
             "engram_n_heads": cfg.engram_n_heads, "engram_head_dim": cfg.engram_head_dim,
             "engram_pad_id": cfg.engram_pad_id, "engram_compressed_vocab_size": cfg.engram_compressed_vocab_size,
             "n_mtp_layers": cfg.n_mtp_layers, "dspark_block_size": cfg.dspark_block_size,
             "dspark_noise_token_id": cfg.dspark_noise_token_id,
             "dspark_target_layer_ids": list(cfg.dspark_target_layer_ids), "dspark_markov_rank": cfg.dspark_markov_rank,
             "dspark_n_routed_experts": cfg.dspark_n_routed_experts,
             "dspark_n_activated_experts": cfg.dspark_n_activated_experts}
    assert {k: flat[k] for k in pairs} == pairs


def test_release_geometry_parses(golden_root):
    cfg = parse_config(json.loads((golden_root / "release-config.json").read_text()))
    assert (cfg.n_layers, cfg.kv_source_of(19), cfg.kv_source_of(39), cfg.candidate_source_layer) == (40, 14, 20, 20)
    assert cfg.compress_ratios[40:] == (0, 0, 0) and cfg.engram_n_hash_cols == 24


def test_checkpoint_tensors_decode_to_reference_dtypes(golden_root):
    ck = load_release_checkpoint(golden_root / "c1")
    w = ck.weights
    assert not any(k.endswith(".scale") for k in w)
    assert w["layers.0.attn.wq_a.weight"].dtype == torch.float32  # FP8 dequantized exactly
    assert w["layers.0.attn.wo_a.weight"].dtype == torch.bfloat16  # as REF's convert.py
    assert w["layers.0.ffn.experts.0.w1.weight"].shape == (64, 128)  # FP4 unpacked
    assert w["layers.1.engram.embed.weight"].dtype == torch.bfloat16
    assert w["embed.weight"].dtype == torch.bfloat16 and w["layers.0.hc_attn_fn"].dtype == torch.float32
