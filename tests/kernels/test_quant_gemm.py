"""Quantized GEMMs (FP8 block-scaled, packed FP4, grouped) and activation fake-quantization.

The torch references are checked against engine/weights.py's decoders (an independent decode)
plus torch matmul; the CPU path (kernels.*) and the Triton kernels (under TRITON_INTERPRET on a
machine without a GPU: tiny shapes only) are checked against the references on random inputs
and on edge values.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_quant_gemm, reference
from _kv_inputs import adversarial_rows
from _quant_inputs import (SCALE_DTYPES, abs_gemm, activations, assert_gemm_close, fp4_weight, fp8_weight,
                           scale_tensor)
from engine.checkpoint import quantize_fp4_rows, quantize_fp8_blocks
from engine.weights import dequantize_fp4, dequantize_fp8

triton_interpreted = pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy overflow notes on Inf/NaN


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal values, NaN where NaN (any payload)."""
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a.masked_fill(nan, 0).view(torch.int32),
                                                            b.masked_fill(nan, 0).view(torch.int32))


def force_cpu_path(monkeypatch, fused: bool) -> None:
    """Move both thresholds (FP8's and FP4's) so every call takes the fused kernels or the tiled path."""
    for name in ("GEMV_MAX_ROWS", "FP4_GEMV_MAX_ROWS"):
        monkeypatch.setattr(cpu_quant_gemm, name, 1 << 30 if fused else 0)


@pytest.fixture(params=["fused", "tiled"])
def cpu_path(request, monkeypatch):
    """Both CPU paths: the fused row kernels (taken up to GEMV_MAX_ROWS / FP4_GEMV_MAX_ROWS
    rows) and the tiled decode + sgemm path (taken above), forced by moving the thresholds."""
    force_cpu_path(monkeypatch, request.param == "fused")
    return request.param


@pytest.fixture(params=["cpu-fused", "cpu-tiled", "triton"])
def impl(request, monkeypatch):
    """The op set under test: kernels.* on CPU tensors (either CPU path), or the Triton module
    (interpreted)."""
    if request.param.startswith("cpu"):
        force_cpu_path(monkeypatch, request.param == "cpu-fused")
        return kernels
    return pytest.importorskip("kernels.triton.quant_gemm")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def poison_scale(s: torch.Tensor, index: int) -> None:
    """Make flat scale element ``index`` NaN: E8M0 byte 0xFF, or an fp32 NaN."""
    if s.dtype == torch.float32:
        s.view(-1)[index] = float("nan")
    else:
        s.view(torch.uint8).view(-1)[index] = 255


# ---- the references against an independent decode ---------------------------------------------

@pytest.mark.parametrize("shape,block", [((48, 96), (16, 32)), ((3, 32, 64), (32, 32)), ((256, 128), (128, 128))])
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32])
def test_fp8_reference_dequant_matches_engine_decoder(shape, block, scale_dtype):
    w, s = fp8_weight(shape, block, gen(1), scale_dtype)
    w.view(torch.uint8).view(-1)[:4] = torch.tensor([0x7F, 0xFF, 0x01, 0xFE], dtype=torch.uint8)  # NaN, subnormal, -448
    poison_scale(s, -1)
    assert same(reference.dequantize_fp8_weight(w, s, block), dequantize_fp8(w, s))


@pytest.mark.parametrize("shape", [(40, 64), (2, 16, 96)])
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32])
def test_fp4_reference_dequant_matches_engine_decoder(shape, scale_dtype):
    p, s = fp4_weight(shape, 32, gen(2), scale_dtype)
    poison_scale(s, 0)
    assert same(reference.dequantize_fp4_weight(p, s), dequantize_fp4(p, s))


def test_reference_linears_are_engine_dequant_times_matmul():
    g = gen(3)
    w = torch.randn(64, 96, generator=g)
    x = activations(7, 96, g)
    q8, s8 = quantize_fp8_blocks(w, 32)
    assert torch.equal(reference.fp8_linear(x, q8, s8, (32, 32)), x @ dequantize_fp8(q8, s8).T)
    q4, s4 = quantize_fp4_rows(w)
    assert torch.equal(reference.fp4_linear(x, q4, s4), x @ dequantize_fp4(q4, s4).T)
    xq = reference.act_quant_fp8(x)
    assert torch.equal(reference.fp4_linear(x, q4, s4, act_quant=True), xq @ dequantize_fp4(q4, s4).T)


def test_reference_grouped_is_grouped_mm_of_engine_dequant():
    g = gen(4)
    p, s = fp4_weight((3, 24, 64), 32, g)
    x = activations(10, 64, g)
    offsets = torch.tensor([2, 2, 8], dtype=torch.int32)          # expert 1 empty, rows 8..9 unrouted
    w = dequantize_fp4(p, s)                                       # [E, N, K]
    out = reference.fp4_grouped_mm(x, p, s, offsets)
    expected = F.grouped_mm(x, w.transpose(1, 2), offs=offsets)    # leaves rows past offs[-1] unwritten
    assert_gemm_close(out[:8], expected[:8], abs_gemm(x, w, False, offsets)[:8], 64)
    assert torch.equal(out[8:], torch.zeros(2, 24))


def _independent_act_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per group with Python floats for the scale and torch's e4m3 cast for the rounding."""
    out = torch.empty_like(x)
    floor = float(torch.tensor(1e-4))                              # the fp32 floor
    for r in range(x.shape[0]):
        for g0 in range(0, x.shape[1], group):
            seg = x[r, g0:g0 + group]
            mantissa, exponent = math.frexp(max(float(seg.abs().max()), floor) / 448.0)
            s = 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)
            out[r, g0:g0 + group] = (seg / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return out


def test_reference_act_quant_matches_an_independent_formula():
    g = gen(5)
    x = activations(6, 100, g) * 10
    x[0, :32] = 448.0 * 2.0 ** -3                                  # amax exactly on a power-of-two ratio
    x[1, 32:64] = torch.tensor([0.0, 1e-6] * 16)                   # the 1e-4 floor decides
    x[2, :8] = torch.tensor([1.0625, 1.1875, 17.0, 18.0, 2.0 ** -9, 3 * 2.0 ** -10, 464.0, -465.0])  # ties
    assert same(reference.act_quant_fp8(x), _independent_act_quant(x, 32))
    assert same(reference.act_quant_fp8(x, 128), _independent_act_quant(x, 128))


# ---- activation fake-quantization: implementations vs the reference, bit for bit ---------------

@triton_interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [32, 128])
def test_act_quant_matches_reference_bitwise(impl, dtype, group):
    x = torch.cat([adversarial_rows(100)[::3], activations(8, 100, gen(6)) * 1e3]).to(dtype)  # K=100: ragged group
    out = impl.act_quant_fp8(x, group)
    assert out.dtype == dtype and out.shape == x.shape
    assert same(out, reference.act_quant_fp8(x, group))


def test_act_quant_special_values():
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([float("nan"), 3.0, -7.0, 0.5])
    x[0, 32:36] = torch.tensor([float("inf"), 1.0, -1e30, 0.0])
    out = kernels.act_quant_fp8(x)
    assert torch.isnan(out[0, 0]) and not torch.isnan(out[0, 1:]).any()   # NaN stays, others unaffected
    assert torch.equal(out[0, 1:4], torch.tensor([3.0, -7.0, 0.5]))        # exact e4m3 values survive
    # The Inf group gets s = 2^120: Inf saturates and overflows back to Inf, the rest flush to +-0.
    assert out[0, 32] == float("inf") and out[0, 33] == 0 and out[0, 34] == 0 and torch.signbit(out[0, 34])
    assert bool((out[0, 36:] == 0).all())


# ---- GEMMs: implementations vs the reference ------------------------------------------------------

CPU_FP8_CASES = [(5, 40, 100, (16, 32)), (1, 128, 256, (128, 128)), (33, 70, 96, (32, 32)), (0, 16, 32, (16, 16))]
TRITON_FP8_CASES = [(5, 24, 80, (16, 32)), (20, 40, 48, (32, 16)), (3, 20, 40, (128, 128))]


def _check_fp8(impl, m, n, k, block, act_quant, scale_dtype, x_dtype, out_dtype, seed):
    g = gen(seed)
    w, s = fp8_weight((n, k), block, g, scale_dtype)
    x = activations(m, k, g, x_dtype)
    out = impl.fp8_linear(x, w, s, block, act_quant=act_quant, out_dtype=out_dtype)
    ref = reference.fp8_linear(x, w, s, block, act_quant=act_quant, out_dtype=out_dtype)
    assert_gemm_close(out, ref, abs_gemm(x, reference.dequantize_fp8_weight(w, s, block), act_quant), k)


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("m,n,k,block", CPU_FP8_CASES)
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_cpu_fp8_linear_matches_reference(m, n, k, block, act_quant, scale_dtype):
    _check_fp8(kernels, m, n, k, block, act_quant, scale_dtype, torch.float32, torch.float32, m + n)


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.bfloat16, None), (torch.float16, torch.bfloat16),
                                               (torch.bfloat16, torch.float16)])
def test_cpu_fp8_linear_dtypes(x_dtype, out_dtype):
    _check_fp8(kernels, 9, 48, 64, (16, 32), True, torch.float8_e8m0fnu, x_dtype, out_dtype, 7)


def test_cpu_path_tiles_cover_every_row(monkeypatch):
    force_cpu_path(monkeypatch, fused=False)
    monkeypatch.setattr(cpu_quant_gemm, "TILE_BYTES", 1)          # one scale block (or one row) per tile
    _check_fp8(kernels, 4, 40, 100, (16, 32), False, torch.uint8, torch.float32, torch.float32, 8)
    g = gen(9)
    p, s = fp4_weight((7, 64), 32, g)
    x = activations(3, 64, g)
    assert_gemm_close(kernels.fp4_linear(x, p, s), reference.fp4_linear(x, p, s),
                      abs_gemm(x, reference.dequantize_fp4_weight(p, s), False), 64)



def test_cpu_rows_up_to_the_threshold_take_the_fused_kernels(monkeypatch):
    """Calls up to the threshold (GEMV_MAX_ROWS rows for FP8, FP4_GEMV_MAX_ROWS for FP4, per
    expert for the grouped ops) never decode a weight tile; one row more switches to the tiled
    path. Both sides match the reference."""
    m, m4 = cpu_quant_gemm.GEMV_MAX_ROWS, cpu_quant_gemm.FP4_GEMV_MAX_ROWS
    tiled_calls = []
    real_tiled = cpu_quant_gemm._tiled_mm
    monkeypatch.setattr(cpu_quant_gemm, "_tiled_mm", lambda *a: tiled_calls.append(a[0].shape[0]) or real_tiled(*a))
    for rows in (m, m + 1):
        _check_fp8(kernels, rows, 40, 100, (16, 32), True, torch.uint8, torch.float32, torch.float32, rows)
    for rows in (m4, m4 + 1):
        _check_fp4(kernels, rows, 33, 96, False, torch.uint8, torch.float32, torch.float32, rows)
    assert tiled_calls == [m + 1, m4 + 1]
    tiled_calls.clear()
    _check_grouped(kernels, True, [m4, m4, 2 * m4], 2 * m4, 64, act_quant=False, seed=20)      # m4 rows per expert
    assert tiled_calls == []
    row_kernel_calls = []
    for name in ("_fp8_gemv", "_fp8_grouped_gemv"):
        real = getattr(cpu_quant_gemm, name)
        monkeypatch.setattr(cpu_quant_gemm, name, lambda *a, _n=name, _f=real: row_kernel_calls.append(_n) or _f(*a))
    _check_grouped(kernels, False, [1, m + 2, m + 3, m + 3, m + 5], m + 5, 64, act_quant=True, seed=21)
    assert tiled_calls == [m + 1]                  # only the expert above the threshold
    assert row_kernel_calls == ["_fp8_grouped_gemv"]  # the other three (one empty) in one call

@triton_interpreted
@pytest.mark.parametrize("m,n,k,block", TRITON_FP8_CASES)
def test_triton_fp8_linear_matches_reference(m, n, k, block):
    qg = pytest.importorskip("kernels.triton.quant_gemm")
    _check_fp8(qg, m, n, k, block, m % 2 == 1, torch.float8_e8m0fnu, torch.bfloat16, torch.float32, m)


@triton_interpreted
@pytest.mark.parametrize("scale_dtype,x_dtype,out_dtype", [(torch.uint8, torch.float32, torch.bfloat16),
                                                           (torch.float32, torch.float16, torch.float16)])
def test_triton_fp8_linear_dtypes(scale_dtype, x_dtype, out_dtype):
    qg = pytest.importorskip("kernels.triton.quant_gemm")
    _check_fp8(qg, 17, 20, 48, (16, 16), False, scale_dtype, x_dtype, out_dtype, 11)


def _check_fp4(impl, m, n, k, act_quant, scale_dtype, x_dtype, out_dtype, seed):
    g = gen(seed)
    p, s = fp4_weight((n, k), 32, g, scale_dtype)
    x = activations(m, k, g, x_dtype)
    out = impl.fp4_linear(x, p, s, act_quant=act_quant, out_dtype=out_dtype)
    ref = reference.fp4_linear(x, p, s, act_quant=act_quant, out_dtype=out_dtype)
    assert_gemm_close(out, ref, abs_gemm(x, reference.dequantize_fp4_weight(p, s), act_quant), k)


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("m,n,k", [(5, 40, 96), (1, 256, 512), (17, 33, 80), (0, 8, 64)])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_cpu_fp4_linear_matches_reference(m, n, k, act_quant, scale_dtype):
    _check_fp4(kernels, m, n, k, act_quant, scale_dtype, torch.float32, torch.float32, m + k)


@pytest.mark.usefixtures("cpu_path")
def test_cpu_fp4_linear_bf16():
    _check_fp4(kernels, 6, 24, 64, True, torch.float8_e8m0fnu, torch.bfloat16, None, 12)


@triton_interpreted
@pytest.mark.parametrize("m,n,k,act_quant", [(5, 24, 80, False), (18, 20, 64, True)])
def test_triton_fp4_linear_matches_reference(m, n, k, act_quant):
    qg = pytest.importorskip("kernels.triton.quant_gemm")
    _check_fp4(qg, m, n, k, act_quant, torch.float8_e8m0fnu, torch.bfloat16, None, m)


@triton_interpreted
def test_triton_bf16_output_rounds_to_nearest_even():
    """Integer data make every partial sum exact, so the bf16 output must equal the exact sum
    rounded to nearest even: 257 -> 256, 259 -> 260, 261.5 -> 262 ... checked bit for bit."""
    qg = pytest.importorskip("kernels.triton.quant_gemm")
    n, k = 16, 32
    w = torch.ones(n, k).to(torch.float8_e4m3fn)                    # code 1.0 everywhere
    s = torch.full((1, 1), 127, dtype=torch.uint8)                  # scale 1
    x = torch.zeros(3, k)
    x[0, :3] = torch.tensor([255.0, 1.0, 1.0])                      # 257: tie, down to even 256
    x[1, :3] = torch.tensor([255.0, 3.0, 1.0])                      # 259: tie, up to even 260
    x[2, :2] = torch.tensor([261.0, 0.5])                           # 261.5: above the tie, 262
    out = qg.fp8_linear(x, w, s, (16, 32), out_dtype=torch.bfloat16)
    assert torch.equal(out, (x.sum(1, keepdim=True).expand(3, n)).to(torch.bfloat16))
    assert out[:, 0].tolist() == [256.0, 260.0, 262.0]


# ---- edge values --------------------------------------------------------------------------------

def _special_fp8() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, set[int]]:
    """N=40, K=80 with 16x32 blocks (ragged in both): a zero block, max, subnormal and NaN codes,
    scale 2^-127 and a NaN scale block. Returns (x, w, s, the NaN columns)."""
    g = gen(13)
    w, s = fp8_weight((40, 80), (16, 32), g, torch.uint8)
    codes = w.view(torch.uint8)
    codes[0:16, 32:64] = 0                                          # zero block
    codes[16:32, 0:8] = torch.tensor([0x7E, 0xFE] * 4, dtype=torch.uint8)   # +-448
    codes[32:40, 0:14] = torch.tensor(list(range(1, 8)) + list(range(0x81, 0x88)), dtype=torch.uint8)  # subnormals
    codes[35, 5] = 0x7F                                             # a NaN code -> column 35
    s[2, 0] = 0                                                     # 2^-127 (its products are subnormal)
    s[1, 2] = 255                                                   # NaN scale -> columns 16..31
    x = activations(6, 80, g)
    x[1, :] = 0                                                     # a zero row still meets the NaNs
    x[2, 32:64] = 0                                                 # a zero activation group
    return x, w, s, set(range(16, 32)) | {35}


@triton_interpreted
@pytest.mark.parametrize("act_quant", [False, True])
def test_fp8_edge_values(impl, act_quant):
    x, w, s, nan_cols = _special_fp8()
    out = impl.fp8_linear(x, w, s, (16, 32), act_quant=act_quant, out_dtype=torch.float32)
    ref = reference.fp8_linear(x, w, s, (16, 32), act_quant=act_quant, out_dtype=torch.float32)
    assert_gemm_close(out, ref, abs_gemm(x, reference.dequantize_fp8_weight(w, s, (16, 32)), act_quant), 80)
    assert {c for c in range(40) if torch.isnan(out[:, c]).all()} == nan_cols
    assert not torch.isnan(out[:, sorted(set(range(40)) - nan_cols)]).any()


@triton_interpreted
def test_fp4_edge_values(impl):
    g = gen(14)
    p, s = fp4_weight((20, 96), 32, g, torch.uint8)
    b = p.view(torch.uint8)
    b[0, :] = 0x77                                                  # +6, +6
    b[1, :] = 0xFF                                                  # -6, -6
    b[2, :] = torch.tensor([0x91, 0x19, 0x88, 0x08], dtype=torch.uint8).repeat(12)   # +-0.5 (subnormal), -0
    b[4, 16:32] = 0                                                 # a zero group
    s[5, :] = 0                                                     # 2^-127
    s[3, 1] = 255                                                   # NaN scale -> column 3
    x = activations(7, 96, g)
    x[0, 40:50] = float("nan")                                      # NaN activation -> row 0
    out = impl.fp4_linear(x, p, s, out_dtype=torch.float32)
    ref = reference.fp4_linear(x, p, s, out_dtype=torch.float32)
    assert_gemm_close(out, ref, abs_gemm(x, reference.dequantize_fp4_weight(p, s), False), 96)
    nan = torch.zeros(7, 20, dtype=torch.bool)
    nan[0, :] = True
    nan[:, 3] = True
    assert torch.equal(torch.isnan(out), nan)


@pytest.mark.usefixtures("cpu_path")
def test_overflowing_scale_follows_ieee():
    x = torch.ones(2, 32)
    x[1, 0] = -1.0
    w = torch.full((16, 32), 448.0).to(torch.float8_e4m3fn)
    s = torch.full((1, 1), 254, dtype=torch.uint8)                  # 448 * 2^127 is +Inf in fp32
    out = kernels.fp8_linear(x, w, s, (16, 32), out_dtype=torch.float32)
    assert same(out, reference.fp8_linear(x, w, s, (16, 32), out_dtype=torch.float32))
    assert bool((out[0] == float("inf")).all()) and bool(torch.isnan(out[1]).all())   # inf - inf is NaN


# ---- grouped GEMMs ----------------------------------------------------------------------------------

OFFSETS = [[0, 4, 4, 10], [10, 10, 10, 10], [0, 0, 0, 0], [2, 5, 7, 7]]   # empty experts; unrouted tail rows


def _check_grouped(impl, fp4: bool, offsets: list[int], s_rows: int, k: int, act_quant: bool, seed: int,
                   nan_expert: int | None = None):
    g = gen(seed)
    e, n = len(offsets), 24
    x = activations(s_rows, k, g, torch.bfloat16)
    offs = torch.tensor(offsets, dtype=torch.int32)
    if fp4:
        w, s = fp4_weight((e, n, k), 32, g, torch.uint8)
        w_deq = lambda: reference.dequantize_fp4_weight(w, s)     # noqa: E731
        run = lambda f: f.fp4_grouped_mm(x, w, s, offs, act_quant=act_quant, out_dtype=torch.float32)  # noqa: E731
    else:
        w, s = fp8_weight((e, n, k), (16, 32), g, torch.uint8)
        w_deq = lambda: reference.dequantize_fp8_weight(w, s, (16, 32))   # noqa: E731
        run = lambda f: f.fp8_grouped_mm(x, w, s, offs, (16, 32), act_quant=act_quant,  # noqa: E731
                                         out_dtype=torch.float32)
    if nan_expert is not None:
        s[nan_expert, 0, 0] = 255                                   # NaN block in one expert only
    out, ref = run(impl), run(reference)
    assert_gemm_close(out, ref, abs_gemm(x, w_deq(), act_quant, offs), k)
    assert torch.equal(out[offsets[-1]:], torch.zeros(s_rows - offsets[-1], n))
    return out


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("offsets", OFFSETS)
@pytest.mark.parametrize("fp4", [False, True])
def test_cpu_grouped_matches_reference(offsets, fp4):
    _check_grouped(kernels, fp4, offsets, 10, 64, act_quant=True, seed=sum(offsets))


@triton_interpreted
@pytest.mark.parametrize("offsets", [[0, 4, 4, 10], [2, 5, 7, 7]])
@pytest.mark.parametrize("fp4", [False, True])
def test_triton_grouped_matches_reference(offsets, fp4):
    qg = pytest.importorskip("kernels.triton.quant_gemm")
    _check_grouped(qg, fp4, offsets, 10, 64, act_quant=fp4, seed=sum(offsets))


@triton_interpreted
def test_triton_grouped_many_tiles_per_expert():
    qg = pytest.importorskip("kernels.triton.quant_gemm")
    _check_grouped(qg, True, [0, 37, 40], 45, 32, act_quant=False, seed=15)   # 3 M tiles for expert 1


@triton_interpreted
@pytest.mark.parametrize("fp4", [False, True])
def test_grouped_nan_scale_stays_in_its_expert(impl, fp4):
    offsets = [3, 3, 9]
    out = _check_grouped(impl, fp4, offsets, 9, 64, act_quant=False, seed=16, nan_expert=2)
    cols = 1 if fp4 else 16                                         # FP4: row 0's first group; FP8: block 0
    assert bool(torch.isnan(out[3:9, :cols]).all())
    assert not torch.isnan(out[:3]).any() and not torch.isnan(out[3:9, cols:]).any()


@pytest.mark.usefixtures("cpu_path")
def test_grouped_zero_rows():
    p, s = fp4_weight((2, 8, 64), 32, gen(17))
    out = kernels.fp4_grouped_mm(torch.zeros(0, 64), p, s, torch.zeros(2, dtype=torch.int32))
    assert out.shape == (0, 8)


# ---- argument validation ------------------------------------------------------------------------

def test_invalid_arguments_raise():
    w, s = fp8_weight((32, 64), (16, 32), gen(18))
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="scale must have shape"):
        kernels.fp8_linear(x, w, s, (32, 32))
    with pytest.raises(ValueError, match="K=48"):
        kernels.fp8_linear(x[:, :48], w, s, (16, 32))
    with pytest.raises(ValueError, match="weight must be one of"):
        kernels.fp8_linear(x, w.float(), s, (16, 32))
    p, s4 = fp4_weight((2, 8, 64), 32, gen(19))
    with pytest.raises(ValueError, match="non-decreasing"):
        kernels.fp4_grouped_mm(x, p, s4, torch.tensor([2, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="within"):
        kernels.fp4_grouped_mm(x, p, s4, torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="offsets must be"):
        kernels.fp4_grouped_mm(x, p, s4, torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="power of two"):
        kernels.act_quant_fp8(x, 24)
    assert scale_tensor(torch.tensor([127], dtype=torch.uint8), torch.float32).item() == 1.0


# ---- GPU (compiled Triton, bf16 dot) ------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 100])
def test_gpu_triton_matches_reference(m):
    g = gen(m)
    x = activations(m, 512, g, torch.bfloat16)
    w, s = fp8_weight((384, 512), (128, 128), g)
    out = kernels.fp8_linear(x.cuda(), w.cuda(), s.cuda(), (128, 128), act_quant=True)
    ref = reference.fp8_linear(x, w, s, (128, 128), act_quant=True)
    assert_gemm_close(out.cpu(), ref, abs_gemm(x, reference.dequantize_fp8_weight(w, s, (128, 128)), True), 512)
    p, s4 = fp4_weight((4, 256, 512), 32, g)
    offs = torch.tensor([0, m // 3, m // 2, m], dtype=torch.int32)
    out = kernels.fp4_grouped_mm(x.cuda(), p.cuda(), s4.cuda(), offs.cuda(), act_quant=True)
    ref = reference.fp4_grouped_mm(x, p, s4, offs, act_quant=True)
    assert_gemm_close(out.cpu(), ref, abs_gemm(x, reference.dequantize_fp4_weight(p, s4), True, offs), 512)
    assert same(kernels.act_quant_fp8(x.cuda()).cpu(), reference.act_quant_fp8(x))


@pytest.mark.parametrize("decode", ["e4m3_value", "e4m3_fast"])
def test_e4m3_decodes_give_every_codes_value(decode):
    """cpu_quant_gemm's e4m3 decodes (integer arithmetic; the half-conversion one the kernels
    use): all 256 bytes, bit for bit (±0, subnormals, 448, NaN)."""
    import numpy as np
    from numba import njit

    from kernels import cpu_quant_gemm

    value = getattr(cpu_quant_gemm, decode)

    @njit
    def decode_all(codes, out):
        for j in range(codes.shape[0]):
            out[j] = value(codes[j])

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = np.empty(256, np.float32)
    decode_all(codes.numpy(), out)
    want = codes.view(torch.float8_e4m3fn).float()
    got = torch.from_numpy(out)
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))


def test_fp8_gemv_equals_the_decoded_weight_product_bit_for_bit():
    """The fused GEMV scales the activations instead of the weights (e4m3 · (a · s) against the
    reference's (e4m3 · s) · a): with power-of-two scales both products are exact, so each
    product, and a one-element dot, is the reference's to the bit, every code included."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).view(256, 1)
    codes = codes.repeat(1, 3)                                   # [256, 3]: three K blocks of 1
    scale = torch.tensor([[2.0**-7, 2.0**3, 1.0]]).expand(256, 3).contiguous()  # per-row blocks
    for k in range(3):
        x = torch.zeros(1, 3)
        x[0, k] = -1.7
        got = kernels.fp8_linear(x, codes, scale, (1, 1), out_dtype=torch.float32)
        want = reference.dequantize_fp8_weight(codes, scale, (1, 1)) @ x[0]
        assert same(got[0], want)


@pytest.mark.parametrize("k", [1, 31, 33, 256, 300, 2100])
@pytest.mark.parametrize("grouped", [False, True])
def test_fp8_gemv_rows_do_not_depend_on_their_neighbours(k, grouped):
    """The fused FP8 GEMV decodes each weight row inside the dot product, four or two activation
    rows per pass and a last odd row alone, over tiles of weight rows (7 rows at k = 2100), and
    at one activation row four weight rows per pass (a quarter of a block apart, 163 rows
    leaving tails): every row's output must equal the same row
    computed alone, bit for bit, whatever the row count (batch invariance), and stay within the
    reference's bound."""
    g = torch.Generator().manual_seed(k)
    w, s = fp8_weight((3, 163, k) if grouped else (163, k), (32, 32), g)
    x = activations(cpu_quant_gemm.GEMV_MAX_ROWS, k, g)
    for m in range(1, x.shape[0] + 1):
        if grouped:
            ends = torch.tensor([0, m, m], dtype=torch.int32)          # every row through expert 1
            out = kernels.fp8_grouped_mm(x[:m], w, s, ends, (32, 32), out_dtype=torch.float32)
            alone = [kernels.fp8_grouped_mm(x[i:i + 1], w, s, torch.tensor([0, 1, 1], dtype=torch.int32),
                                            (32, 32), out_dtype=torch.float32)[0] for i in range(m)]
            ref = reference.fp8_grouped_mm(x[:m], w, s, ends, (32, 32), out_dtype=torch.float32)
        else:
            out = kernels.fp8_linear(x[:m], w, s, (32, 32), out_dtype=torch.float32)
            alone = [kernels.fp8_linear(x[i:i + 1], w, s, (32, 32), out_dtype=torch.float32)[0] for i in range(m)]
            ref = reference.fp8_linear(x[:m], w, s, (32, 32), out_dtype=torch.float32)
        assert all(same(out[i], alone[i]) for i in range(m)), f"{m} rows"
        wd = reference.dequantize_fp8_weight(w[1] if grouped else w, s[1] if grouped else s, (32, 32))
        assert_gemm_close(out, ref, abs_gemm(x[:m], wd, False), k)


@pytest.mark.parametrize("k", [32, 96, 1024])
@pytest.mark.parametrize("grouped", [False, True])
def test_fp4_gemv_rows_do_not_depend_on_their_neighbours(k, grouped):
    """The fused FP4 GEMV decodes a weight row once and dots it with every activation row: each
    row's output must equal the same row computed alone, bit for bit, whatever the row count up
    to FP4_GEMV_MAX_ROWS (batch invariance, which a multi-row pass must keep), and stay within
    the reference's bound."""
    g = torch.Generator().manual_seed(k)
    w, s = fp4_weight((3, 37, k) if grouped else (37, k), 32, g)
    x = activations(cpu_quant_gemm.FP4_GEMV_MAX_ROWS, k, g)

    def product(rows: torch.Tensor) -> torch.Tensor:
        if grouped:                                                     # every row through expert 1
            ends = torch.tensor([0, rows.shape[0], rows.shape[0]], dtype=torch.int32)
            return kernels.fp4_grouped_mm(rows, w, s, ends, out_dtype=torch.float32)
        return kernels.fp4_linear(rows, w, s, out_dtype=torch.float32)

    alone = [product(x[i:i + 1])[0] for i in range(x.shape[0])]
    wd = reference.dequantize_fp4_weight(w[1] if grouped else w, s[1] if grouped else s)
    for m in (2, 3, 4, 5, 6, 7, 9, 16, 31, x.shape[0]):
        out = product(x[:m])
        assert all(same(out[i], alone[i]) for i in range(m)), f"{m} rows"
        assert_gemm_close(out, x[:m] @ wd.T, abs_gemm(x[:m], wd, False), k)
