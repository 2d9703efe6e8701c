"""`ringserve memory-report`: per-rank weight bytes against a hand count of the tiny model,
KV sequences against the pool arithmetic, the released V4-Flash parameter count (284.33B),
and the command as a user runs it. DeepSeek-V4.1: each rank's bytes and parameters by kind
against what loading the tiny V4.1 checkpoint with that rank's expert share allocates (and
the routed experts against a hand count), its KV sizing through `V41KVCache`, and the
released V4.1-Flash config's totals against model-spec (763B, 552B backbone, ~196B Engram)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from pathlib import Path

from engine.v4.checkpoint import preset_config, quantization_config
from engine.v4.weights import build_model
from server.memory_report import kind_of, memory_report, render

V41_RELEASE = Path(__file__).resolve().parents[2] / ".." / "shared" / "golden" / "deepseek-v4.1" / "release-config.json"


def _fp8(n: int, k: int, block: int = 16) -> int:
    return n * k + math.ceil(n / block) * math.ceil(k / block)  # e4m3 codes + one e8m0 byte per block


def _fp4(n: int, k: int) -> int:
    return n * k // 2 + n * math.ceil(k / 32)  # two codes per byte + one e8m0 byte per 32


def _bf16(n: int, k: int) -> int:
    return 2 * n * k


def _hand_count(local_experts: int) -> dict[str, int]:
    """Bytes per kind of the tiny preset stored fp8-fp4 (16×16 blocks), compute dtype bf16,
    every MoE layer holding `local_experts` experts: one line per tensor."""
    d, hd, heads, q, og, ol, v, n, inter = 64, 32, 4, 32, 2, 16, 512, 4, 32
    f32 = 4
    attention = (_fp8(q, d) + f32 * q + _fp8(heads * hd, q) + _fp8(hd, d) + f32 * hd
                 + _fp8(og * ol, heads * hd // og) + _fp8(d, og * ol) + f32 * heads)

    def compressor(width: int, out: int, ratio: int) -> int:  # wkv, wgate, ape, norm
        return 2 * _bf16(width, d) + f32 * ratio * width + f32 * out

    csa = compressor(2 * hd, hd, 4) + _fp8(4 * 16, q) + _bf16(4, d) + compressor(2 * 16, 16, 4)  # + indexer
    hca = compressor(hd, hd, 8)
    shared = 2 * _fp8(inter, d) + _fp8(d, inter)
    routed = local_experts * (_fp4(2 * inter, d) + _fp4(d, inter))
    hyper_site = f32 * ((2 + n) * n * n * d + (2 + n) * n + 3)
    block_norms = 2 * f32 * d + 2 * hyper_site
    hc_head = f32 * (n * n * d + n + 1)
    router = _bf16(8, d)  # gate (compute dtype); + fp32 bias, or the int32 tid2eid of the hash layer
    mtp = (2 * f32 * d + 2 * _fp8(d, d) + f32 * d + hc_head  # enorm, hnorm, e/h_proj, norm, hc head
           + attention + block_norms + shared + routed + router + f32 * 8)
    return {
        "attention": 4 * attention, "compressor+indexer": 2 * csa + hca, "routed experts": 4 * routed,
        "shared experts": 4 * shared, "embed+head": 2 * _bf16(v, d), "mHC+norms": 4 * block_norms + f32 * d + hc_head,
        "MTP": mtp, "other": 4 * router + 3 * f32 * 8 + 4 * v * 2,
    }


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    cfg = preset_config("tiny")
    raw = cfg.to_upstream_dict()
    raw["quantization_config"] = quantization_config(cfg)
    path = tmp_path_factory.mktemp("memreport") / "config.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("ranks, ep, redundant, local", [(1, False, 0, 8), (2, True, 0, 4), (4, True, 4, 3)])
def test_weight_bytes_equal_a_hand_count(tiny_config, ranks, ep, redundant, local):
    report = memory_report(str(tiny_config), ranks, ep, redundant, gpu_memory_gib=1.0, reserve_gib=0.0,
                           kv_dtype="bf16", context=64)
    got = {kind: row["bytes"] for kind, row in report["weights"].items()}
    assert got == _hand_count(local)
    assert report["routed_experts_per_layer"] == local


def test_a_checkpoint_dir_reports_what_its_config_describes(tiny_config, checkpoint_factory):
    path = checkpoint_factory("tiny-fp8-fp4", dtype=torch.bfloat16, quantize="fp8-fp4", index_topk=64)
    from_dir = memory_report(str(path), 2, True, gpu_memory_gib=1.0, reserve_gib=0.0)
    assert {k: r["bytes"] for k, r in from_dir["weights"].items()} == _hand_count(4)


def test_sequences_that_fit_follow_the_pool_arithmetic(tiny_config):
    context = 4096
    report = memory_report(str(tiny_config), gpu_memory_gib=0.05, reserve_gib=0.0, kv_dtype="bf16",
                           context=context, max_num_batched_tokens=2048)
    budget = report["kv_budget_bytes"]
    # Per 256-token block, bf16 records: full pools c4 (2 layers × 32 × 2 B × 64 records), idx4
    # (2 × 16 × 2 × 64), c8 (1 × 32 × 2 × 32); window pools swa (5 layers incl. MTP × 32 × 2 × 256)
    # and fp32 compressor rows state_c4_csa (2 × 128 × 4 × 256), state_idx4 (2 × 64 × 4 × 256),
    # state_c8_hca (1 × 64 × 4 × 256).
    full = 2 * 64 * 64 + 2 * 32 * 64 + 64 * 32
    sliding = 5 * 64 * 256 + 2 * 512 * 256 + 2 * 256 * 256 + 256 * 256

    def fits(seqs: int) -> bool:
        window_blocks = 3 * seqs + 2048 // 256 + 1  # 3 per sequence (16 positions kept) + one step's
        full_blocks = (budget - window_blocks * sliding) // full
        return full_blocks - 1 >= seqs * (context // 256)  # block 0 is the engine's dummy

    want = max(s for s in range(1, 200) if fits(s))
    assert report["sequences"] == want and not fits(want + 1)
    assert report["kv_pool_bytes"] <= budget


def test_released_v4_flash_has_284_33b_parameters():
    from engine.config import ModelConfig
    from engine.v4.weight_formats import formats_from_config
    from engine.v4.weights import configure
    from server.memory_report import _weights_by_kind, resolve_model

    cfg = ModelConfig.from_model_dir(resolve_model("deepseek-v4-flash"))
    dense = build_model(cfg, with_mtp=False)
    assert round(sum(p.numel() for p in dense.parameters()) / 1e9, 2) == 284.33  # model-spec §7
    stored = build_model(cfg, with_mtp=False, dtype=torch.bfloat16)
    configure(stored, formats_from_config(stored, cfg), None)
    kinds = {k: r["params"] / 1e9 for k, r in _weights_by_kind(stored).items()}
    assert round(sum(kinds.values()), 2) == 284.33
    # model-spec §7's split, each to the digits it gives (half a unit of the last one)
    spec = {"routed experts": (277.0, 0.05), "attention": (4.6, 0.05), "shared experts": (1.08, 0.005),
            "embed+head": (1.06, 0.005), "compressor+indexer": (0.49, 0.005), "mHC+norms": (0.03, 0.005)}
    for kind, (billions, digits) in spec.items():
        assert kinds[kind] == pytest.approx(billions, abs=digits), kind


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", "memory-report", *args], capture_output=True,
                          text=True, timeout=300)


def test_memory_report_command_on_8_h200():
    ep = json.loads(_cli("deepseek-v4-flash", "--data-parallel-size", "8", "--enable-expert-parallel",
                         "--num-redundant-experts", "32", "--gpu-memory-gib", "141", "--json").stdout)
    assert ep["fits"] and ep["routed_experts_per_layer"] == 36 and ep["sequences"] > 0
    assert ep["weight_bytes"] + ep["reserve_bytes"] + ep["kv_budget_bytes"] == ep["gpu_bytes"]
    text = _cli("deepseek-v4-flash", "--data-parallel-size", "8", "--gpu-memory-gib", "141")
    assert text.returncode == 0 and "does not fit" in text.stdout  # every rank holding all 256 experts
    bad = _cli("deepseek-v4-flash", "--num-redundant-experts", "32")
    assert bad.returncode == 2 and bad.stderr.startswith("ringserve: error:") and "expert-parallel" in bad.stderr


def test_weight_dtype_flag_reaches_the_engine_config():
    from engine.config import ConfigError, EngineConfig
    from server.cli import build_parser, engine_config_from

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--weight-dtype", "bf16"])
    assert engine_config_from(args).weight_dtype == "bf16"
    assert engine_config_from(build_parser().parse_args(["generate", "--prompt", "hi"])).weight_dtype == "auto"
    assert EngineConfig.from_json(EngineConfig(weight_dtype="bf16").to_json()).weight_dtype == "bf16"
    with pytest.raises(ConfigError, match="--weight-dtype"):
        EngineConfig(weight_dtype="fp8")


# ---- DeepSeek-V4.1 ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v41_tiny(tmp_path_factory):
    """(checkpoint dir, a dir holding only its config.json): the report reads formats from the
    checkpoint's headers in one, from `quantization_config` in the other."""
    from engine.v41.checkpoint import write_v41_checkpoint

    root = tmp_path_factory.mktemp("memreport41")
    ckpt = write_v41_checkpoint(root / "ckpt", "tiny", seed=3, quantize="fp8-fp4")
    bare = root / "config-only"
    bare.mkdir()
    (bare / "config.json").write_text((ckpt / "config.json").read_text())
    return ckpt, bare


def _loaded_by_kind(model) -> dict[str, tuple[int, int]]:
    """kind → (bytes, elements) of what a loaded model actually holds."""
    out: dict[str, list[int]] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        row = out.setdefault(kind_of(name), [0, 0])
        row[0] += t.numel() * t.element_size()
        row[1] += t.numel()
    return {k: (b, n) for k, (b, n) in out.items()}


@pytest.mark.parametrize("ranks, ep, redundant", [(1, False, 0), (2, True, 0), (4, True, 4)])
def test_v41_rank_equals_what_loading_its_share_allocates(v41_tiny, ranks, ep, redundant):
    from engine.config import ModelConfig, ParallelConfig
    from engine.distributed.expert_parallel import experts_to_load, initial_placement
    from engine.v41.weights import load_v41

    ckpt, bare = v41_tiny
    cfg = ModelConfig.from_model_dir(ckpt)
    stages = cfg.num_nextn_predict_layers
    placement = initial_placement(cfg, stages, ParallelConfig(data_parallel_size=ranks, enable_expert_parallel=ep,
                                                              num_redundant_experts=redundant))
    local = (cfg.n_routed_experts + redundant) // ranks
    for source in (bare, ckpt):
        report = memory_report(str(source), ranks, ep, redundant, gpu_memory_gib=0.05, reserve_gib=0.0,
                               kv_dtype="bf16", context=256, block_size=16)
        assert report["routed_experts_per_layer"] == local
        for rank in range(ranks):  # every rank holds the bytes rank 0 stands for
            experts = experts_to_load(placement, rank) if ep else None
            stored = _loaded_by_kind(load_v41(ckpt, experts=experts))
            assert {k: r["bytes"] for k, r in report["weights"].items()} == {k: b for k, (b, _) in stored.items()}
            dense = _loaded_by_kind(load_v41(ckpt, experts=experts, weight_dtype="bf16"))  # one element per param
            assert {k: r["params"] for k, r in report["weights"].items()} == {k: n for k, (_, n) in dense.items()}
    # by hand: w13 [2·inter, dim] + w2 [dim, inter] per expert slot; each DSpark stage whole
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    assert report["weights"]["routed experts"]["params"] == cfg.num_layers * local * 3 * d * inter
    whole = memory_report(str(bare), 1, gpu_memory_gib=0.05, reserve_gib=0.0, kv_dtype="bf16", context=256,
                          block_size=16)
    assert report["weights"]["MTP"] == whole["weights"]["MTP"]  # the DSpark stages are never split
    no_stages = memory_report(str(bare), ranks, ep, redundant, gpu_memory_gib=0.05, reserve_gib=0.0,
                              kv_dtype="bf16", context=256, block_size=16, mtp=False)
    held = _loaded_by_kind(load_v41(ckpt, load_mtp=False, experts=experts))
    assert {k: r["bytes"] for k, r in no_stages["weights"].items()} == {k: b for k, (b, _) in held.items()} | {"MTP": 0}
    assert report["parameters_on_rank"] == sum(n for _, n in dense.values())


def test_v41_sequences_follow_the_v41_pool_sizing(v41_tiny):
    from engine.v41.kv_cache import V41KVCache
    from engine.v41.weights import load_v41

    ckpt, _ = v41_tiny
    context, block = 512, 16
    report = memory_report(str(ckpt), gpu_memory_gib=0.02, reserve_gib=0.0, kv_dtype="bf16", context=context,
                           block_size=block, max_num_batched_tokens=64)
    seqs, budget = report["sequences"], report["kv_budget_bytes"]
    model = load_v41(ckpt)
    assert budget == 0.02 * 2**30 // 1 - sum(b for b, _ in _loaded_by_kind(model).values())

    def fits(n: int) -> bool:  # the engine's own pools, allocated for real on the CPU
        try:
            cache = V41KVCache.for_model(model, "bf16", n, 64, memory_bytes=budget, block_size=block)
        except ValueError:
            return False
        return cache.manager.full.num_blocks - 1 >= n * (context // block)

    assert seqs > 0 and fits(seqs) and not fits(seqs + 1)
    assert 0 < report["kv_pool_bytes"] <= budget


def test_released_v41_flash_totals_match_model_spec():
    """model-spec's table: 763B total; 552B backbone; the Engram tables about 196B."""
    if not V41_RELEASE.exists():
        pytest.skip(f"V4.1 release config not found at {V41_RELEASE}")
    from engine.config import ModelConfig

    whole = memory_report(str(V41_RELEASE), 8, gpu_memory_gib=141.0)
    kinds = {k: r["params"] for k, r in whole["weights"].items()}
    assert round(whole["parameters_on_rank"] / 1e9) == 763
    assert round((whole["parameters_on_rank"] - kinds["Engram"] - kinds["MTP"]) / 1e9) == 552
    v = ModelConfig.from_model_dir(V41_RELEASE).v41
    tables = sum(v.engram_num_embeddings) * v.engram_head_dim
    assert 196e9 <= tables < 197e9 and tables < kinds["Engram"] < tables * 1.01  # + each layer's wkv, q/k
    ep = memory_report(str(V41_RELEASE), 8, True, 32, gpu_memory_gib=141.0)
    assert ep["routed_experts_per_layer"] == (384 + 32) // 8
    assert ep["weights"]["MTP"] == whole["weights"]["MTP"]  # DSpark stages whole on every rank
    assert ep["weight_bytes"] + ep["reserve_bytes"] + ep["kv_budget_bytes"] == ep["gpu_bytes"]


def test_v41_engram_tables_on_the_host_leave_the_gpu(v41_tiny):
    """With --engram-tables host the report's GPU weights are what a host-tables load puts
    outside the CPU-side tables: every kind equals the device report but Engram, which keeps
    only its projections; the tables' bytes are listed as host memory."""
    from engine.v41.weights import load_v41

    ckpt, _ = v41_tiny
    args = dict(gpu_memory_gib=0.05, reserve_gib=0.0, kv_dtype="bf16", context=256, block_size=16)
    device = memory_report(str(ckpt), **args)
    host = memory_report(str(ckpt), engram_tables="host", **args)
    model = load_v41(ckpt, engram_tables="host")
    tables = [b.engram.embed for b in model.layers if getattr(b, "engram", None) is not None]
    table_bytes = sum(t.numel() * t.element_size() for m in tables for t in m.parameters())
    assert tables and host["host_bytes"] == table_bytes > 0
    assert host["weights"]["Engram"]["bytes"] == device["weights"]["Engram"]["bytes"] - table_bytes
    assert {k: r for k, r in host["weights"].items() if k != "Engram"} == \
           {k: r for k, r in device["weights"].items() if k != "Engram"}
    assert host["kv_budget_bytes"] == device["kv_budget_bytes"] + table_bytes
    assert host["parameters_on_rank"] == device["parameters_on_rank"]


def test_released_v41_flash_fits_8_h200_with_host_engram_tables():
    """The Engram tables (189 GiB in FP8) make every 8×H200 setup fail; in host memory the
    expert-parallel ranks keep tens of GiB of KV."""
    if not V41_RELEASE.exists():
        pytest.skip(f"V4.1 release config not found at {V41_RELEASE}")
    on_gpu = memory_report(str(V41_RELEASE), 8, True, gpu_memory_gib=141.0)
    off = memory_report(str(V41_RELEASE), 8, True, gpu_memory_gib=141.0, engram_tables="host")
    assert not on_gpu["fits"] and off["fits"] and off["sequences"] > 0
    assert 188 * 2**30 < off["host_bytes"] < 190 * 2**30
    assert off["weight_bytes"] + off["host_bytes"] == on_gpu["weight_bytes"]
    assert "Engram tables (host)" in render(off)


def test_engram_tables_flag_reaches_the_engine_config():
    from engine.config import ConfigError, EngineConfig
    from server.cli import build_parser, engine_config_from

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--engram-tables", "host"])
    assert engine_config_from(args).engram_tables == "host"
    assert EngineConfig.from_json(EngineConfig(engram_tables="host").to_json()).engram_tables == "host"
    with pytest.raises(ConfigError, match="--engram-tables"):
        EngineConfig(engram_tables="disk")
