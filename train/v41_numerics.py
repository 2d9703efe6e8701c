"""Differentiable DeepSeek-V4.1 numerics for training: QAT fake-quantizers with a straight-through
estimator and the quantized GEMM, on top of the engine's own arithmetic (engine/v41/numerics.py).

Forward = the model's numerics: every quantizer is the engine's (engine/v41/quant.py for
activations and KV, the release writer's `fp8_blocks` / `fp4_rows` for weights, so an export
re-quantizes the trained values without loss); backward = identity through each quantizer
(`ste`). Everything else the engine computes with (bf16 roundings, fp32 / fp64 GEMMs, RoPE, mHC,
sparse attention) is already differentiable torch and is called as it is.

`quant_gemm` has two modes: exact (the engine's: each 32-wide K block's product formed in fp64,
rounded once to fp32, blocks summed in fp32 in K order, one rounding to bf16; bit-identical to
engine/v41/numerics.py `quant_gemm_exact` whatever the row count) and fast (one fp32 GEMM of the
same quantized operands: differs from exact by fp32 accumulation order only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels.reference as kref
from engine.v41 import quant
from engine.v41.checkpoint import fp4_rows, fp8_blocks

GEMM_K_BLOCK = 32


def ste(x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """`quantized`'s values with x's gradient (straight-through)."""
    return x + (quantized - x).detach()


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """Activations / window KV: e4m3 with a ue8m0 scale per 32 (engine/v41/quant.py)."""
    return ste(x, quant.fake_fp8(x.detach(), 32))


def fake_fp4_index(x: torch.Tensor) -> torch.Tensor:
    """Index queries and keys: e2m1 with a ue8m0 scale per 32."""
    return ste(x, quant.fake_fp4_index(x.detach(), 32))


def fake_fp4_kv(x: torch.Tensor) -> torch.Tensor:
    """Compressed KV: e2m1 with an e4m3 scale per 16."""
    return ste(x, quant.fake_fp4_kv(x.detach(), 16))


# ---- weights: the release storage's values ---------------------------------------------------


def fp8_weight_values(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 [R, C] → the values the release stores it as (FP8 e4m3, E8M0 block scales)."""
    codes, scale = fp8_blocks(w.detach().float(), block)
    return kref.dequantize_fp8_weight(codes, scale, block)


def fp4_weight_values(w: torch.Tensor) -> torch.Tensor:
    """fp32 [..., R, C] routed-expert weights → FP4 e2m1 values, one E8M0 scale per 32 along C."""
    flat = w.detach().float().reshape(-1, w.shape[-1])
    packed, scale = fp4_rows(flat, 32)
    return kref.dequantize_fp4_weight(packed, scale, 32).reshape(w.shape)


# ---- GEMMs ----------------------------------------------------------------------------------


def quant_gemm(x: torch.Tensor, weight: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """act_quant(x) [.., K] bf16 times weight values [O, K] (fp32) → bf16 [.., O]."""
    xq = fake_fp8(x)
    shape, k = xq.shape, xq.shape[-1]
    flat = xq.reshape(-1, k)
    if not exact:
        out = F.linear(flat.float(), weight.float()).to(torch.bfloat16)
        return out.reshape(*shape[:-1], weight.shape[0])
    xb = flat.double().unflatten(-1, (-1, GEMM_K_BLOCK))  # [N, K/32, 32]
    wb = weight.double().unflatten(-1, (-1, GEMM_K_BLOCK))  # [O, K/32, 32]
    partial = torch.einsum("nbk,obk->bno", xb, wb).float()  # [K/32, N, O], each block exact, one rounding
    acc = partial[0]
    for b in range(1, partial.shape[0]):  # fp32, in K order
        acc = acc + partial[b]
    return acc.to(torch.bfloat16).reshape(*shape[:-1], weight.shape[0])
