"""--cpu-matmul-precision: what `auto` resolves to; that bf16 reaches the tiled FP8 GEMM as bf16
operands with fp32 accumulation (checked against a float64 product of bf16-rounded activations
and the exactly decoded weight) for products past BF16_MIN_MACS only, while fp32 stays fp32; and
that a whole prefill under bf16 stays within bf16's rounding of the exact logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import cpu_precision
from engine.config import CPU_MATMUL_PRECISIONS, ConfigError, EngineConfig
from engine.weights import dequantize_fp8
from kernels import cpu_quant_gemm
from server.cli import build_parser, engine_config_from

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from _quant_inputs import activations, fp8_weight  # noqa: E402


@pytest.mark.parametrize("precision, dtype, flags, reference, expected", [
    ("auto", "auto", {"avx512f", "amx_bf16", "amx_tile"}, False, "bf16"),
    ("auto", "auto", {"avx512f", "amx_bf16", "amx_tile"}, True, "fp32"),  # V4.1: the reference's GEMMs
    ("auto", "auto", {"avx512f", "avx512_bf16"}, False, "bf16"),  # AVX512-BF16 without AMX (Zen 4)
    ("auto", "auto", {"avx512f", "avx512_bf16"}, True, "fp32"),
    ("auto", "auto", {"avx512f", "avx512_vnni"}, False, "fp32"),  # AVX-512 without bf16 arithmetic
    ("auto", "auto", {"avx2"}, False, "fp32"),
    ("auto", "fp32", {"amx_bf16"}, False, "fp32"),                 # an explicit --dtype fp32 stays exact
    ("auto", "bf16", {"amx_bf16"}, False, "fp32"),
    ("bf16", "fp32", {"avx2"}, True, "bf16"),                      # asked for: taken as asked
    ("fp32", "auto", {"amx_bf16"}, False, "fp32"),
])
def test_resolve(precision, dtype, flags, reference, expected):
    assert cpu_precision.resolve(precision, dtype, flags, reference_numerics=reference) == expected


def test_bad_values_are_refused():
    assert cpu_precision.PRECISIONS == CPU_MATMUL_PRECISIONS     # the config's list, kept torch-free there
    with pytest.raises(ValueError, match="cpu matmul precision"):
        cpu_precision.resolve("tf32")
    with pytest.raises(ConfigError, match="--cpu-matmul-precision"):
        EngineConfig(cpu_matmul_precision="tf32")
    with pytest.raises(ConfigError, match="--batch-invariant"):
        EngineConfig(cpu_matmul_precision="bf16", batch_invariant=True)
    EngineConfig(cpu_matmul_precision="auto", batch_invariant=True)  # auto resolves to fp32 for V4.1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--cpu-matmul-precision", "tf32"])


def test_the_flag_reaches_the_worker_config():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--cpu-matmul-precision", "bf16"])
    config = engine_config_from(args)
    assert EngineConfig.from_json(config.to_json()).cpu_matmul_precision == "bf16"
    assert engine_config_from(build_parser().parse_args(["generate", "--prompt", "x"])).cpu_matmul_precision == "auto"


def test_only_large_products_take_bf16_operands_and_the_setting_is_restored():
    big, small = cpu_precision.BF16_MIN_MACS, cpu_precision.BF16_MIN_MACS - 1
    assert not cpu_precision.bf16_allowed()                          # a test process: exact by default
    with cpu_precision.matmul_precision("bf16") as resolved:
        assert resolved == "bf16" and cpu_precision.bf16_allowed()
        with cpu_precision.bf16_operands(big):
            assert torch.get_float32_matmul_precision() == "medium"
        assert torch.get_float32_matmul_precision() == "highest"
        with cpu_precision.bf16_operands(small):
            assert torch.get_float32_matmul_precision() == "highest"
    assert not cpu_precision.bf16_allowed()
    with cpu_precision.bf16_operands(big):
        assert torch.get_float32_matmul_precision() == "highest"


def _torch_rounds_operands(m: int, k: int, n: int) -> bool:
    """Whether torch's own fp32 matmul of this shape takes bf16 operands under 'medium' on this
    CPU. Where oneDNN has bf16 arithmetic for it (AMX Xeons) it does; on an AMD EPYC (Zen 4,
    AVX512-BF16 without AMX) oneDNN was seen to compute exactly in fp32 (and faster than sgemm)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).bfloat16().float()
    torch.set_float32_matmul_precision("medium")
    try:
        out = (x @ w.T).double()
    finally:
        torch.set_float32_matmul_precision("highest")
    magnitude = x.double().abs() @ w.double().abs().T
    return float(((out - x.double() @ w.double().T).abs() / magnitude).max()) > 1e-5


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tiled_fp8_gemm_under_each_precision(precision, monkeypatch):
    monkeypatch.setattr(cpu_quant_gemm, "GEMV_MAX_ROWS", 0)          # the tiled path (tile decode + mm)
    # Several tiles each way, the last one partial: 128 of the 512 weight rows a tile with exact
    # operands, 384 with bf16 ones (96·256·384 = 9.4 M multiply-adds a tile, past BF16_MIN_MACS).
    monkeypatch.setattr(cpu_quant_gemm, "TILE_BYTES", 4 * 256 * 128)
    monkeypatch.setattr(cpu_quant_gemm, "BF16_TILE_BYTES", 4 * 256 * 384)
    g = torch.Generator().manual_seed(3)
    weight, scale = fp8_weight((512, 256), (128, 128), g)
    x = activations(96, 256, g)                                     # 96·256·512 = 12.6 M multiply-adds
    tiles = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: tiles.append(b.shape[1]) or real_mm(a, b, **kw))
    w = dequantize_fp8(weight, scale).double()                      # exact: e4m3 times a power of two
    with cpu_precision.matmul_precision(precision):
        out = kernels.fp8_linear(x, weight, scale).double()        # [96, 512]
    assert tiles == ([128] * 4 if precision == "fp32" else [384, 128])
    magnitude = x.double().abs() @ w.abs().T                        # the scale of each sum's rounding
    exact = x.double() @ w.T
    bf16_operands = x.bfloat16().double() @ w.T                     # w is exact in bf16 as well
    fp32_bound = 2 * 256 * 2.0**-24 * magnitude + 1e-30
    if precision == "fp32" or not _torch_rounds_operands(96, 256, 512):
        assert bool(((out - exact).abs() <= fp32_bound).all())    # torch's matmul stays fp32 here
    else:
        assert bool(((out - bf16_operands).abs() <= fp32_bound).all())
        assert float(((out - exact).abs() / magnitude).max()) > 1e-4  # bf16 rounding, not fp32's


def test_only_products_with_bf16_operands_take_the_larger_tile(monkeypatch):
    """The tiled path's tile: BF16_TILE_BYTES of fp32 where that tile's product takes bf16
    operands (this process allows them and it is large enough), else TILE_BYTES."""
    n, k = 4096, 256
    monkeypatch.setattr(cpu_quant_gemm, "TILE_BYTES", 4 * k * 128)         # 128 rows
    monkeypatch.setattr(cpu_quant_gemm, "BF16_TILE_BYTES", 4 * k * 1024)   # 1024 rows
    large_m = -(-cpu_precision.BF16_MIN_MACS // (k * 1024))              # a 1024-row tile just reaches it
    with cpu_precision.matmul_precision("fp32"):
        assert cpu_quant_gemm._tile_rows(large_m, n, k, 128) == 128
    with cpu_precision.matmul_precision("bf16"):
        assert cpu_quant_gemm._tile_rows(large_m, n, k, 128) == 1024
        assert cpu_quant_gemm._tile_rows(large_m - 1, n, k, 128) == 128  # too small a product
        assert cpu_quant_gemm._tile_rows(large_m, 100, k, 128) == 128    # N caps the tile's product
        assert cpu_quant_gemm._tile_rows(large_m, n, 3000, 128) == 128   # rows stay a multiple of the block


def _prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    from engine.attention_backend import SequenceStep, StepSeq

    step = SequenceStep([StepSeq(model.new_state(), 0, tokens)], model.device)
    with torch.inference_mode():
        return model.logits(model(step.token_ids, step.positions, step))    # [T, vocab] fp32


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no bf16 matmuls")
def test_a_prefill_with_bf16_operands_stays_near_the_exact_logits(checkpoint_factory, monkeypatch):
    from engine.weights import load_model

    path = checkpoint_factory("tiny-fp8-fp4", dtype=torch.bfloat16, quantize="fp8-fp4", index_topk=64)
    model = load_model(path, dtype=torch.float32, progress=False)
    tokens = torch.randint(3, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    exact = _prefill_logits(model, tokens)
    monkeypatch.setattr(cpu_precision, "BF16_MIN_MACS", 0)           # the tiny model's products are small
    with cpu_precision.matmul_precision("bf16"):
        fast = _prefill_logits(model, tokens)
    err = float((fast - exact).abs().max() / exact.abs().max())
    assert err < 3e-2, err                                          # bf16's rounding: bounded
    if _torch_rounds_operands(40, 256, 256):                          # the tiny model's products
        assert err > 1e-5, err                                      # and present where torch rounds
