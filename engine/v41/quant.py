"""DeepSeek-V4.1's QAT quantizers (all round-to-nearest-even, blocks along the last dim).

  * FP8 activations / window KV: e4m3 with scale 2^ceil(log2(amax/448)) per 32, amax floor 1e-4;
  * FP4 index queries and keys: e2m1 with scale 2^ceil(log2(amax/6)) per 32, floor 6·2^-126;
  * FP4 compressed KV: e2m1 with an e4m3 scale e4m3(amax/6) per 16, floor 6·2^-9. The codes are
    x / (the rounded scale), which can reach 6·(1 + 2^-4): they saturate at 6.
`quantize_*` return (codes as fp32 grid values [..., N/b, b], scales [..., N/b, 1]); `fake_*`
quantize and dequantize in one go, in x.dtype (codes·scale is exact in bf16). A block holding a
NaN or ±Inf dequantizes to all-NaN; the other blocks are untouched.
"""

from __future__ import annotations

import torch

E4M3_MAX, E2M1_MAX = 448.0, 6.0
# (mantissa bits, least normal exponent, largest finite value) of a sign-magnitude minifloat.
E4M3_GRID = (3, -6, E4M3_MAX)
E2M1_GRID = (1, 0, E2M1_MAX)
ACT_FLOOR = 1e-4
INDEX_FLOOR = 6 * 2.0**-126
KV_FLOOR = 6 * 2.0**-9


def to_grid(x: torch.Tensor, grid: tuple[int, int, float]) -> torch.Tensor:
    """Nearest grid value of fp32 x (ties to even), saturating at the largest; NaN stays NaN.
    The quantum at |x| is 2^(floor(log2|x|) − mantissa bits), held at the least normal exponent
    below it (subnormals)."""
    bits, least, top = grid
    mag = x.abs()
    _, e = torch.frexp(mag)  # mag = m·2^e, m in [0.5, 1): floor(log2 mag) = e − 1
    quantum = torch.ldexp(torch.ones_like(mag), torch.clamp(e - 1, min=least) - bits)
    return torch.copysign(torch.clamp(torch.round(mag / quantum) * quantum, max=top), x)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 v) exactly for finite v > 0 (an exact power of two maps to itself)."""
    m, e = torch.frexp(v)
    return torch.ldexp(torch.ones_like(v), e - (m == 0.5).to(e.dtype))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block {block}")
    return x.float().unflatten(-1, (-1, block))


def _nan_poison(xb: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor):
    # Always the select (no test of whether any block is poisoned): a host read on a GPU, and a
    # captured step may not make one. Finite blocks keep their values bit for bit.
    finite = torch.isfinite(xb).all(-1, keepdim=True)  # [..., nb, 1]
    return torch.where(finite, codes, float("nan")), torch.where(finite, scale, float("nan"))


def quantize_fp8(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    xb = _blocks(x, block)
    scale = pow2_ceil(xb.abs().amax(-1, keepdim=True).clamp_min(ACT_FLOOR) / E4M3_MAX)
    return _nan_poison(xb, to_grid(xb / scale, E4M3_GRID), scale)


def quantize_fp4_index(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    xb = _blocks(x, block)
    scale = pow2_ceil(xb.abs().amax(-1, keepdim=True).clamp_min(INDEX_FLOOR) / E2M1_MAX)
    return _nan_poison(xb, to_grid(xb / scale, E2M1_GRID), scale)


def quantize_fp4_kv(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    xb = _blocks(x, block)
    scale = to_grid(xb.abs().amax(-1, keepdim=True).clamp_min(KV_FLOOR) / E2M1_MAX, E4M3_GRID)
    return _nan_poison(xb, to_grid(xb / scale, E2M1_GRID), scale)


def _back(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes * scale).flatten(-2).to(dtype)


def fake_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _back(*quantize_fp8(x, block), x.dtype)


def fake_fp4_index(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _back(*quantize_fp4_index(x, block), x.dtype)


def fake_fp4_kv(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    return _back(*quantize_fp4_kv(x, block), x.dtype)
