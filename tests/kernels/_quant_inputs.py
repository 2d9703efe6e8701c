"""Input builders and the comparison rule shared by the quantized-GEMM tests."""
from __future__ import annotations

import torch

from kernels import reference

E4M3_NAN_CODES = (0x7F, 0xFF)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_tensor(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E8M0 byte codes (uint8) in the requested storage: e8m0, raw bytes, or their fp32 values."""
    if dtype == torch.float32:
        return reference.ue8m0_values(codes)
    return codes.view(dtype)


def fp8_weight(shape: tuple[int, ...], block: tuple[int, int], g: torch.Generator,
               scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> tuple[torch.Tensor, torch.Tensor]:
    """Random finite e4m3 codes [..., N, K] and scales around 1 [..., ceil(N/bN), ceil(K/bK)]."""
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)     # no NaN codes
    *lead, n, k = shape
    s = torch.randint(118, 128, (*lead, cdiv(n, block[0]), cdiv(k, block[1])), generator=g,
                      dtype=torch.int32).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn), scale_tensor(s, scale_dtype)


def fp4_weight(shape: tuple[int, ...], group: int, g: torch.Generator,
               scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed e2m1 int8 [..., N, K/2] and scales [..., N, ceil(K/group)] for shape [..., N, K]."""
    *lead, n, k = shape
    packed = torch.randint(-128, 128, (*lead, n, k // 2), generator=g, dtype=torch.int32).to(torch.int8)
    s = torch.randint(120, 132, (*lead, n, cdiv(k, group)), generator=g, dtype=torch.int32).to(torch.uint8)
    return packed, scale_tensor(s, scale_dtype)


def quant_weight(kind: str, shape: tuple[int, ...], g: torch.Generator):
    """(codes, scales, block, dequantized fp32 weight) of a random FP8 (16x32 blocks) or FP4
    (groups of 32) weight of logical shape [..., N, K]."""
    if kind == "fp8":
        w, s = fp8_weight(shape, (16, 32), g)
        return w, s, (16, 32), reference.dequantize_fp8_weight(w, s, (16, 32))
    w, s = fp4_weight(shape, 32, g)
    return w, s, (1, 32), reference.dequantize_fp4_weight(w, s)


def activations(m: int, k: int, g: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of mixed magnitude (a decade spread per row) so act-quant scales differ per group."""
    return (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))).to(dtype)


def assert_gemm_close(out: torch.Tensor, ref: torch.Tensor, abs_ref: torch.Tensor, k: int) -> None:
    """out equals ref up to fp32 summation order: same NaN and Inf positions, and
    |out - ref| <= 2K * 2^-24 * sum_k |a||w| (+ one bf16/fp16 ulp when out is 16-bit: the two
    fp32 sums may round to neighbouring 16-bit values).

    abs_ref is the same GEMM on |a| and |w| (the sum of the magnitudes of the terms)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    o, r = out.float(), ref.float()
    assert torch.equal(torch.isnan(o), torch.isnan(r)), "NaN positions differ"
    assert torch.equal(torch.isinf(o), torch.isinf(r)) and torch.equal(o[torch.isinf(o)], r[torch.isinf(r)])
    finite = torch.isfinite(r)
    bound = 2 * max(k, 1) * 2.0 ** -24 * abs_ref.float()
    if out.dtype != torch.float32:
        bound = bound + r.abs() * 2.0 ** (-7 if out.dtype == torch.bfloat16 else -10) + 2.0 ** -24
    err = (o - r).abs()
    assert bool((err[finite] <= bound[finite] + 1e-37).all()), f"max excess {(err - bound)[finite].max()}"


def abs_gemm(x: torch.Tensor, w: torch.Tensor, act_quant: bool, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM of |a| and |w| (w dequantized fp32 [(E,) N, K]): the scale of its rounding error."""
    a = reference._act_quant_f32(x, reference.ACT_GROUP) if act_quant else x.float()
    if offsets is None:
        return a.abs() @ w.abs().T
    return reference._grouped(a.abs(), w.abs(), offsets)
