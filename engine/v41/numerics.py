"""The arithmetic of DeepSeek-V4.1 as its reference defines it, in two numerics modes.

Activations are bf16 between ops. Three GEMM kinds exist (weights hold their values exactly,
whether FP8/FP4-stored or dense):
  * `quant_gemm`  FP8/FP4-stored weights: the activation is fake-quantized to e4m3 (ue8m0 per
                  32) first; each 32-wide K block's product is exact (formed in fp64), blocks
                  accumulate in fp32 in K order, one rounding to bf16;
  * `bf16_gemm`   bf16-kept weights: the sum formed in fp64, one rounding to bf16;
  * `fp32_gemm`   weights promoted to fp32: a plain fp32 GEMM.

`Numerics` says how row-count-dependent operations run:
  * reference (default): as REF runs on a CPU. An fp32 GEMM's kernel (hence its last bits)
    depends on the number of rows, and vectorised sigmoid / silu / softplus round a buffer's tail
    elements differently, so the model applies those per sequence: a sequence's chunk gets the
    bits the plain reference forward gives that chunk, whatever else shares the step;
  * row_independent: fp32 GEMMs row by row, transcendental functions in fp64, attention sums in
    fp64, top-k ties to the lowest position. A token's result then never depends on its chunk,
    so decode, chunked prefill, verification and full prefill agree bit for bit.
`exact=False` swaps the exact block GEMM for the kernels' fp32-accumulated FP8/FP4 GEMMs (the
fast path; not bit-exact to the reference).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import model_math
from kernels.sinkhorn import sinkhorn

from .quant import quantize_fp8

GEMM_K_BLOCK = 32  # quantized GEMMs accumulate one 32-wide K block at a time
ATTN_BLOCK = 64  # the online softmax visits the selected keys 64 at a time
ATTN_GATHER_BYTES = 64 << 20  # fp32 keys gathered for one block of queries (bounds prefill memory)
_GEMM_ROWS = 256  # rows per fp64 block-product chunk (bounds the [K/32, rows, O] buffer)


@dataclass(frozen=True)
class Numerics:
    row_independent: bool = False
    exact: bool = True


_mode = Numerics()


@contextmanager
def numerics(mode: Numerics):
    """Run the enclosed forward under `mode` (restored afterwards)."""
    global _mode
    before, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = before


def current() -> Numerics:
    return _mode


# ---- elementwise transcendental functions ------------------------------------------------------


def _elementwise(fn, x: torch.Tensor) -> torch.Tensor:
    return fn(x.double()).to(x.dtype) if _mode.row_independent else fn(x)


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
    """Statistics and the (bf16) weight product in fp32, one rounding to x.dtype (the shared norm)."""
    return model_math.rms_norm(x, weight, eps)


# ---- the three GEMM kinds ------------------------------------------------------------------------


def quant_gemm_exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """act_quant(x) [.., K] bf16 times a weight's exact values (fp64 [O, K]) → bf16 [.., O].

    Each 32-wide block's product holds at most ~41 significant bits, so fp64 forms it exactly
    (hence independently of how many rows share the call); it is rounded once to fp32 and the
    blocks are summed in fp32 in K order."""
    shape, k = x.shape, x.shape[-1]
    flat = x.reshape(-1, k)
    out = torch.empty(flat.shape[0], weight.shape[0], dtype=torch.bfloat16, device=x.device)
    wb = weight.unflatten(-1, (-1, GEMM_K_BLOCK)).permute(1, 2, 0)  # [K/32, 32, O]
    for lo in range(0, flat.shape[0], _GEMM_ROWS):
        codes, scale = quantize_fp8(flat[lo:lo + _GEMM_ROWS], GEMM_K_BLOCK)  # [n, K/32, 32], [n, K/32, 1]
        xq = (codes * scale).double().transpose(0, 1)  # [K/32, n, 32]
        partial = torch.bmm(xq, wb).float()  # [K/32, n, O], each exact then rounded once
        acc = partial[0]
        for b in range(1, partial.shape[0]):
            acc = acc + partial[b]
        out[lo:lo + _GEMM_ROWS] = acc.to(torch.bfloat16)
    return out.reshape(*shape[:-1], weight.shape[0])


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16 x [.., K] times bf16 weight [O, K]: fp64 sum, one rounding to bf16."""
    return F.linear(x.double(), weight.double()).to(torch.bfloat16)


def bf16_grouped_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Block-diagonal bf16 projection x [T, G, d] × weight [G, R, d] → [T, G, R], as bf16_gemm."""
    return torch.einsum("tgd,grd->tgr", x.double(), weight.double()).to(torch.bfloat16)


def fp32_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x [N, K] times fp32 weight [O, K] → fp32 [N, O]; row by row when row-independent."""
    x = x.float()
    if _mode.row_independent and x.shape[0] > 1:
        return torch.cat([F.linear(x[i:i + 1], weight) for i in range(x.shape[0])])
    return F.linear(x, weight)


# ---- rotary embedding ------------------------------------------------------------------------------


def rope_freqs(rope_dim: int, theta: float, yarn) -> torch.Tensor:
    """fp32 [rope_dim/2] angular frequencies; YaRN (no mscale) blends the interpolated ones in,
    rounded as V4.1's reference (kernels/model_math.py `yarn_inv_freq`, quotient)."""
    return model_math.yarn_inv_freq(rope_dim, theta, yarn, quotient=True)


def rotation(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """complex64 [T, rope_dim/2]: e^{i·pos·freq}, the angle formed in fp32."""
    angles = torch.outer(positions.to(torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last rope channels of x ([T, D] or [T, H, D]) as interleaved pairs by a complex
    fp32 product, rounded back to x.dtype; `inverse` rotates by −θ."""
    rd = 2 * rot.shape[-1]
    r = rot.conj() if inverse else rot
    if x.dim() == 3:
        r = r[:, None, :]
    pairs = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
    rotated = torch.view_as_real(pairs * r).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


# ---- sparse attention and top-k ---------------------------------------------------------------------


def _dot(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _mode.row_independent:
        return torch.einsum(eq, a.double(), b.double()).float()
    return torch.einsum(eq, a, b)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [T, H, D] bf16; kv [N, D] bf16 (K = V); idx [T, K] rows of kv per query, −1 masked;
    sink [H] fp32 → [T, H, D] bf16. Online softmax over blocks of 64 keys, probabilities rounded
    to bf16 before PV (fp32 accumulate), the sink only in the denominator.
    Queries go ATTN_GATHER_BYTES of gathered fp32 keys at a time: every row is computed on its
    own keys alone, and the gather for a whole long prefill chunk (T·K·D·4 bytes) would be tens
    of GB."""
    rows = max(1, ATTN_GATHER_BYTES // max(1, idx.shape[1] * q.shape[-1] * 4))
    if q.shape[0] <= rows:
        return _sparse_attention_rows(q, kv, idx, sink, scale)
    return torch.cat([_sparse_attention_rows(q[i:i + rows], kv, idx[i:i + rows], sink, scale)
                      for i in range(0, q.shape[0], rows)])


def _sparse_attention_rows(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                           scale: float) -> torch.Tensor:
    t, h, d = q.shape
    valid = idx >= 0
    # [T, K, D]; a masked slot's row is zeroed: its probability is 0, but 0 × a NaN of whatever
    # bytes that slot's row holds (a recycled block) is NaN.
    keys = kv[idx.clamp_min(0)].float().masked_fill_(~valid[..., None], 0.0)
    row_max = torch.full((t, h), -math.inf, device=q.device)
    denom = torch.zeros(t, h, device=q.device)
    acc = torch.zeros(t, h, d, device=q.device)
    qf = q.float()
    for lo in range(0, idx.shape[1], ATTN_BLOCK):
        kb, ok = keys[:, lo:lo + ATTN_BLOCK], valid[:, lo:lo + ATTN_BLOCK]
        s = (_dot("thd,tkd->thk", qf, kb) * scale).masked_fill(~ok[:, None, :], -math.inf)
        new_max = torch.maximum(row_max, s.amax(-1))
        safe = torch.where(torch.isinf(new_max), 0.0, new_max)
        rescale = exp(row_max - safe)
        p = exp(s - safe[..., None])  # [T, H, k]
        p_sum = p.double().sum(-1).float() if _mode.row_independent else p.sum(-1)
        denom = denom * rescale + p_sum
        acc = acc * rescale[..., None] + _dot("thk,tkd->thd", p.bfloat16().float(), kb)
        row_max = new_max
    safe = torch.where(torch.isinf(row_max), 0.0, row_max)
    denom = denom + exp(sink.float()[None, :] - safe)
    return (acc / denom[..., None]).to(torch.bfloat16)


def top_indices(scores: torch.Tensor, k: int, sorted_ref: bool = False) -> torch.Tensor:
    """[T, k] indices of the k largest scores per row: torch.topk as REF (unsorted, or sorted for
    candidate blocks and the router), or ties to the lowest position when row-independent."""
    if _mode.row_independent:
        return torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    return scores.topk(k, dim=-1, sorted=sorted_ref).indices


# ---- mHC ------------------------------------------------------------------------------------------


def split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [T, (2+hc)·hc] fp32 → pre [T, hc] = σ(m·s0+b)+eps, post [T, hc] = 2σ(m·s1+b), comb
    [T, hc, hc]: row softmax + eps, column-normalise, then (iters − 1) × (rows, columns), each
    dividing by (sum + eps) — the kernel's order."""
    pre = sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
    comb = exp(comb - comb.amax(-1, keepdim=True))
    comb = comb / comb.sum(-1, keepdim=True) + eps
    return pre, post, sinkhorn(comb, iters, eps)


def hc_collapse(stream: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_k pre_k · H_k in fp32, rounded to bf16: [T, hc, D] × [T, hc] → [T, D] (the shared collapse)."""
    return model_math.hc_collapse(stream, pre)


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """H'_k = post_k · y + Σ_j comb[j, k] · H_j in fp32, rounded to bf16 (the stream is bf16)."""
    return model_math.hc_expand(residual, y, post, comb, accumulate="fp32")
