"""Stateless tensor ops of the plain V4.1 reference, each with REF's dtype flow.

Activations are bf16 between ops (REF runs with torch's default dtype bf16). Each function says
where it rounds to bf16 and what it does in fp32. The three TileLang kernels REF calls
(fp8/fp4 GEMM, sparse_attn, hc_split_sinkhorn) follow the golden README's stand-ins.
Shapes carry no batch dimension: one sequence, T tokens.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from functools import lru_cache

import torch
import torch.nn.functional as F

from .quant import quantize_fp8
from .release_checkpoint import YarnRope

SPARSE_ATTN_BLOCK = 64  # the online softmax visits the selected keys 64 at a time
GEMM_K_BLOCK = 32  # quantized GEMMs accumulate one 32-wide K block at a time

# ---- row-independent numerics ------------------------------------------------------------------
# REF (and, by default, this reference) is not row-independent on CPU: an fp32 GEMM's kernel
# depends on its row count, vectorised exp/sigmoid round a buffer's tail elements differently,
# and torch.topk's choice among tied scores depends on the row's width. Inside
# `row_independent_numerics()` fp32 GEMMs run one row at a time, transcendental functions are
# evaluated in fp64 (then rounded), and top-k ties go to the lowest position, so a token's
# result no longer depends on the chunk it is computed in: decode, chunked prefill and full
# prefill then agree bit for bit. The golden comparisons run outside it.
_row_independent = False


@contextmanager
def row_independent_numerics(enabled: bool = True):
    global _row_independent
    if _row_independent:
        raise RuntimeError("row_independent_numerics is not re-entrant")
    _row_independent = enabled
    try:
        yield
    finally:
        _row_independent = False


def is_row_independent() -> bool:
    return _row_independent


def _elementwise(fn, x: torch.Tensor) -> torch.Tensor:
    return fn(x.double()).to(x.dtype) if _row_independent else fn(x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(torch.exp, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(torch.sigmoid, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(F.softplus, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(F.silu, x)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _elementwise(lambda v: v.softmax(dim=dim), x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 statistics, fp32 product with the (bf16) weight, then one rounding to x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


# ---- linears --------------------------------------------------------------------------------


def quantized_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """FP8/FP4-stored weight (already dequantized, fp32 [O, K]) on a bf16 activation.

    REF quantizes the activation to e4m3 with a ue8m0 scale per 32 first; the stand-in GEMM
    accumulates one 32-wide K block at a time in fp32 and rounds the result to bf16. Here each
    block's partial product is formed exactly (in fp64: e4m3·e4m3 and e2m1·e4m3 products of one
    block need at most ~41 bits) and rounded once to fp32, so a row's result never depends on how
    many rows share the call; the blocks then accumulate in fp32 in K order.
    """
    shape = x.shape
    codes, scale = quantize_fp8(x.reshape(-1, shape[-1]), GEMM_K_BLOCK)  # [N, K/32, 32], [N, K/32, 1]
    xq = (codes * scale).double()
    wb = weight.double().unflatten(-1, (-1, GEMM_K_BLOCK))  # [O, K/32, 32]
    partial = torch.bmm(xq.transpose(0, 1), wb.permute(1, 2, 0)).float()  # [K/32, N, O], exact → fp32
    acc = partial[0]
    for b in range(1, partial.shape[0]):
        acc = acc + partial[b]
    return acc.to(torch.bfloat16).reshape(*shape[:-1], weight.shape[0])


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A bf16-stored weight REF keeps bf16 (F.linear in bf16): bf16 in, one rounding to bf16.

    Accumulated in fp64, i.e. (nearly always) the correctly rounded result. On the CPUs checked
    this equals oneDNN's bf16 GEMM bit for bit, but does not depend on its kernel choice or JIT."""
    return F.linear(x.double(), weight.double()).to(torch.bfloat16)


def bf16_grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Block-diagonal bf16 projection, REF's einsum("bsgd,grd->bsgr") in bf16, rounded once as
    bf16_linear. x [T, G, d], weight [G, R, d] → [T, G, R]."""
    return torch.einsum("tgd,grd->tgr", x.double(), weight.double()).to(torch.bfloat16)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A weight REF promotes to fp32 (mHC mixes, ratio-2 compressor, router, head): fp32 in and out.

    CPU fp32 GEMMs pick kernels by row count, so a row's last bits depend on how many rows share
    the call (REF's prefill and decode differ this way too); row-independent numerics run each
    row alone.
    """
    x, weight = x.float(), weight.float()
    if _row_independent and x.shape[0] > 1:
        return torch.cat([F.linear(x[i:i + 1], weight) for i in range(x.shape[0])])
    return F.linear(x, weight)


# ---- rotary embedding -------------------------------------------------------------------------


@lru_cache(maxsize=None)
def rope_frequencies(rope_dim: int, theta: float, yarn: YarnRope | None) -> torch.Tensor:
    """fp32 [rope_dim/2] angular frequencies, with YaRN's blend when given (no mscale).

    YaRN keeps the frequencies whose wavelength fits the original context (pair index below
    `low`), divides those far beyond it by `factor` (above `high`), and ramps linearly between.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None:
        return freqs

    def pair_index_of(rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_index_of(yarn.beta_fast)), 0)
    high = min(math.ceil(pair_index_of(yarn.beta_slow)), rope_dim - 1)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp
    return freqs / yarn.factor * (1 - keep) + freqs * keep


def rope_rotation(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """complex64 [T, rope_dim/2]: e^{i·pos·freq}, the angle formed in fp32 as REF does."""
    angles = torch.outer(positions, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last rope_dim channels of x ([T, D] or [T, H, D]) as interleaved (even, odd)
    pairs; the product is complex fp32, then rounded back to x.dtype. `inverse` rotates by −θ
    (attention outputs: V carried the key's rotation)."""
    rd = 2 * rotation.shape[-1]
    rot = rotation.conj() if inverse else rotation
    if x.dim() == 3:
        rot = rot[:, None, :]
    pairs = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
    rotated = torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


# ---- sparse attention ---------------------------------------------------------------------------


def _sum_dot(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """einsum in fp32; under row-independent numerics formed in fp64 (bf16 products are exact
    there) and rounded to fp32, so the result no longer depends on the summed length."""
    if _row_independent:
        return torch.einsum(eq, a.double(), b.double()).float()
    return torch.einsum(eq, a, b)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """REF's sparse_attn stand-in. q [T, H, D] bf16; kv [N, D] bf16 (K = V); idx [T, K] rows of
    kv per query, -1 = masked; sink [H] fp32. Returns [T, H, D] bf16.

    Scores q·k in fp32 times `scale`; an online softmax over blocks of 64 selected keys, whose
    probabilities are rounded to bf16 before the PV product (fp32 accumulate); the sink joins
    only the denominator, exp(sink − max). A row with nothing selected returns 0.
    """
    t, h, _ = q.shape
    keys = kv[idx.clamp_min(0)].float()  # [T, K, D]
    valid = idx >= 0  # [T, K]
    row_max = torch.full((t, h), -math.inf)
    denom = torch.zeros(t, h)
    acc = torch.zeros(t, h, q.shape[-1])
    for lo in range(0, idx.shape[1], SPARSE_ATTN_BLOCK):
        k_blk, ok = keys[:, lo:lo + SPARSE_ATTN_BLOCK], valid[:, lo:lo + SPARSE_ATTN_BLOCK]
        s = _sum_dot("thd,tkd->thk", q.float(), k_blk) * scale
        s = s.masked_fill(~ok[:, None, :], -math.inf)
        new_max = torch.maximum(row_max, s.amax(-1))
        safe_max = torch.where(torch.isinf(new_max), 0.0, new_max)  # all masked so far
        rescale = exp(row_max - safe_max)
        p = exp(s - safe_max[..., None])  # [T, H, k]
        p_sum = p.double().sum(-1).float() if _row_independent else p.sum(-1)
        denom = denom * rescale + p_sum
        acc = acc * rescale[..., None] + _sum_dot("thk,tkd->thd", p.bfloat16().float(), k_blk)
        row_max = new_max
    safe_max = torch.where(torch.isinf(row_max), 0.0, row_max)
    denom = denom + exp(sink.float()[None, :] - safe_max)
    return (acc / denom[..., None]).to(torch.bfloat16)


# ---- mHC (hyper-connections) ----------------------------------------------------------------


def split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc: int,
                   iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_split_sinkhorn in the kernel's order, fp32. mixes [T, (2+hc)·hc] →
    pre [T, hc] = σ(m·s0 + b) + eps, post [T, hc] = 2σ(m·s1 + b), comb [T, hc, hc]:
    row softmax + eps, then column-normalise, then (iters − 1) × (row, column) normalisations,
    each dividing by (sum + eps)."""
    pre = sigmoid(mixes[:, :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * sigmoid(mixes[:, hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc])
    comb = (mixes[:, 2 * hc:] * hc_scale[2] + hc_base[2 * hc:]).view(-1, hc, hc)
    comb = exp(comb - comb.amax(-1, keepdim=True))
    comb = comb / comb.sum(-1, keepdim=True) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_mixes(stream: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, hc: int,
             iters: int, norm_eps: float, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """stream [T, hc, D] bf16 → (pre, post, comb) of one site. The flattened hc·D stream is
    RMS-scaled in fp32 with norm_eps (not hc_eps), then projected by fn [(2+hc)·hc, hc·D]
    (the one fp32 GEMM whose row-count-dependent rounding visibly moves REF's outputs)."""
    xf = stream.flatten(1).float()
    mixes = fp32_linear(xf, fn) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    return split_sinkhorn(mixes, scale, base, hc, iters, hc_eps)


def hc_collapse(stream: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_k pre_k · H_k in fp32, rounded to bf16. [T, hc, D] × [T, hc] → [T, D]."""
    return torch.sum(pre[..., None] * stream.float(), dim=1).to(stream.dtype)


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """H'_k = post_k · y + Σ_j comb[j, k] · H_j in fp32, rounded to bf16 (comb used transposed).
    y [T, D]; residual [T, hc, D]; post [T, hc]; comb [T, hc, hc] → [T, hc, D]."""
    mixed = torch.sum(comb[..., None] * residual[:, :, None, :].float(), dim=1)  # sum over j
    return (post[..., None] * y[:, None, :].float() + mixed).to(y.dtype)
