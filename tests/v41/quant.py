"""DeepSeek-V4.1's QAT quantizers, written from the golden README's definitions.

The golden data (`shared/golden/deepseek-v4.1/c*/README.md`, "Kernel stand-ins") fixes them:
  * act_quant: e4m3 RNE with one ue8m0 scale 2^ceil(log2(amax/448)) per 32, amax floor 1e-4;
  * fp4 (index q/k): e2m1 RNE with one ue8m0 scale 2^ceil(log2(amax/6)) per 32, floor 6·2^-126;
  * fp4 (compressed KV): e2m1 RNE with one e4m3 scale e4m3(amax/6) per 16, floor 6·2^-9.
"Fake" forms quantize and dequantize in one go (REF's in-place variants), returning x.dtype.

Non-finite input: a block holding a NaN or ±Inf dequantizes to all-NaN (its amax, hence its
scale, is not finite; REF's arithmetic gives the same, via inf/inf and 0·inf). Everything else
is exact: scales are computed with frexp (no log2 rounding), and the grids saturate at their
maximum (only reachable by the e4m3-scaled fp4, whose rounded scale can sit below amax/6).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# (mantissa bits, smallest normal exponent, largest value) of the two sign-magnitude grids.
E4M3 = (3, -6, E4M3_MAX)
E2M1 = (1, 0, E2M1_MAX)

ACT_AMAX_FLOOR = 1e-4
FP4_E8M0_AMAX_FLOOR = 6 * 2.0**-126
FP4_E4M3_AMAX_FLOOR = 6 * 2.0**-9


def round_to_grid(x: torch.Tensor, grid: tuple[int, int, float]) -> torch.Tensor:
    """Round fp32 x to the nearest value of a minifloat grid (ties to even), saturating.

    The quantum at |x| is 2^(e - mantissa_bits) with e = floor(log2|x|), held at the smallest
    normal exponent below it (the subnormal range). NaN stays NaN; ±Inf saturates.
    """
    mantissa_bits, min_exponent, max_value = grid
    a = x.abs()
    _, e = torch.frexp(a)  # a = m · 2^e with m in [0.5, 1), so floor(log2 a) = e - 1
    exponent = torch.clamp(e - 1, min=min_exponent)
    quantum = torch.ldexp(torch.ones_like(a), exponent - mantissa_bits)
    q = torch.round(a / quantum) * quantum  # torch.round rounds half to even
    return torch.copysign(torch.clamp(q, max=max_value), x)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 v) for finite v > 0, exactly (a ue8m0 scale)."""
    m, e = torch.frexp(v)  # v = m · 2^e, m in [0.5, 1): an exact power of two has m == 0.5
    return torch.ldexp(torch.ones_like(v), e - (m == 0.5).to(e.dtype))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., N] → fp32 [..., N / block, block]."""
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block {block}")
    return x.float().unflatten(-1, (-1, block))


def _poison_nonfinite(xb: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor):
    finite = torch.isfinite(xb)
    if bool(finite.all()):
        return codes, scale
    bad = ~finite.all(-1, keepdim=True)  # [..., n_blocks, 1]
    nan = torch.full_like(scale, float("nan"))
    return torch.where(bad, float("nan"), codes), torch.where(bad, nan, scale)


def quantize_fp8(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant: codes (fp32 values on the e4m3 grid) [..., N/b, b] and ue8m0 scales [..., N/b, 1]."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(ACT_AMAX_FLOOR)
    scale = pow2_ceil(amax / E4M3_MAX)
    codes = round_to_grid(xb / scale, E4M3)  # |xb / scale| <= 448 by construction
    return _poison_nonfinite(xb, codes, scale)


def quantize_fp4_e8m0(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Index q/k: e2m1 codes [..., N/b, b] and ue8m0 scales [..., N/b, 1]."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_E8M0_AMAX_FLOOR)
    scale = pow2_ceil(amax / E2M1_MAX)
    codes = round_to_grid(xb / scale, E2M1)
    return _poison_nonfinite(xb, codes, scale)


def quantize_fp4_e4m3(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed KV: e2m1 codes [..., N/b, b] and e4m3 scales e4m3(amax/6) [..., N/b, 1].

    The floor 6·2^-9 makes the smallest scale 2^-9, the least e4m3 subnormal, so a scale is
    never zero. Rounding the scale can leave |x / scale| up to 6·(1 + 2^-4): it saturates to 6.
    """
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_E4M3_AMAX_FLOOR)
    scale = round_to_grid(amax / E2M1_MAX, E4M3)
    codes = round_to_grid(xb / scale, E2M1)
    return _poison_nonfinite(xb, codes, scale)


def _dequant(codes: torch.Tensor, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # codes·scale has at most 4+4 significant bits, so the cast to bf16 (or fp32) is exact
    return (codes * scale).flatten(-2).to(like.dtype)


def fake_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """act_quant in place: quantize then dequantize, result in x.dtype."""
    return _dequant(*quantize_fp8(x, block), like=x)


def fake_fp4_e8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _dequant(*quantize_fp4_e8m0(x, block), like=x)


def fake_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    return _dequant(*quantize_fp4_e4m3(x, block), like=x)
