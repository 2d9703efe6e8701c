"""mHC mixing weights (and the pre-weighted collapse) of one hyper-connection site in one kernel.

engine/v4/layers.py `hc_mix_weights` is ~270 small torch ops per site at 20 Sinkhorn iterations
(each a launch on a GPU); here one program handles BLOCK_T tokens end to end:
  flat = streams[t] flattened (n·D, fp32); r = rsqrt(mean(flat²) + norm_eps)
  mix = r · (fn @ flat)                        [(2+n)·n]: pre | post | comb logits
  pre = σ(mix_pre·scale0 + base_pre) + hc_eps;  post = 2·σ(mix_post·scale1 + base_post)
  comb = softmax_rows(mix_comb·scale2 + base_comb) + hc_eps, then Sinkhorn: columns, then
         (rows, columns) × (iters − 1), each division by (sum + hc_eps)
  collapsed (optional) = Σ_k pre_k · H_k        [D], in the streams' dtype (engine hc_collapse).
The projection streams fn once per token block (tl.dot over n·D chunks), so a decode batch of
T tokens reads fn ⌈T / BLOCK_T⌉ times; the streams are read once (twice with the collapse).
Shapes: streams [T, n, D]; fn [(2+n)·n, n·D]; base [(2+n)·n]; scale [3]; n·n a power of two >= 16
(n = 4 in DeepSeek-V4). Returns pre [T, n], post [T, n], comb [T, n, n] fp32 (+ collapsed [T, D]).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import kv_codec
from kernels.decode_reference import check_mhc_mix as _check
from kernels.decode_reference import mhc_mix_reference  # noqa: F401 (re-exported)


@triton.jit
def _project(acc, x, fn_ptr, row0, rows, ND, cols, PRECISION: tl.constexpr):
    """acc [BT, W] += x [BT, CH] @ fn[row0 + j, cols]ᵀ for j < rows (W = the tile width)."""
    j = tl.arange(0, acc.shape[1])
    f = tl.load(fn_ptr + (row0 + j).to(tl.int64)[:, None] * ND + cols[None, :], mask=(j < rows)[:, None],
                other=0.0).to(tl.float32)                                           # [W, CH]
    return acc + tl.dot(x, tl.trans(f), input_precision=PRECISION)


@triton.jit
def _mhc_mix_kernel(streams_ptr, fn_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, out_ptr, norm_ptr, T, ITERS,
                    hc_eps, norm_eps, norm_out_eps, N: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                    CH: tl.constexpr, COLLAPSE: tl.constexpr, NORM: tl.constexpr, BF16: tl.constexpr,
                    PRECISION: tl.constexpr):
    ND: tl.constexpr = N * D
    NN: tl.constexpr = N * N
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    rows = t.to(tl.int64)[:, None] * ND
    acc_pre = tl.zeros([BLOCK_T, 16], tl.float32)
    acc_post = tl.zeros([BLOCK_T, 16], tl.float32)
    acc_comb = tl.zeros([BLOCK_T, NN], tl.float32)
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    for c0 in range(0, ND, CH):
        cols = c0 + tl.arange(0, CH)
        x = tl.load(streams_ptr + rows + cols[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)  # [BT, CH]
        sumsq += tl.sum(x * x, axis=1)
        acc_pre = _project(acc_pre, x, fn_ptr, 0, N, ND, cols, PRECISION)
        acc_post = _project(acc_post, x, fn_ptr, N, N, ND, cols, PRECISION)
        acc_comb = _project(acc_comb, x, fn_ptr, 2 * N, NN, ND, cols, PRECISION)
    r = tl.math.rsqrt(sumsq / ND + norm_eps)[:, None]                               # [BT, 1]
    j = tl.arange(0, 16)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(acc_pre * r * s0 + tl.load(base_ptr + j, mask=j < N, other=0.0)[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(acc_post * r * s1 + tl.load(base_ptr + N + j, mask=j < N, other=0.0)[None, :])
    out_cols = t.to(tl.int64)[:, None] * N + j[None, :]
    out_mask = tmask[:, None] & (j < N)[None, :]
    tl.store(pre_ptr + out_cols, pre, mask=out_mask)
    tl.store(post_ptr + out_cols, post, mask=out_mask)
    jj = tl.arange(0, NN)
    logits = acc_comb * r * s2 + tl.load(base_ptr + 2 * N + jj)[None, :]
    logits = tl.reshape(logits, [BLOCK_T, N, N])                                    # [BT, j, k] row-major
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)                       # columns first
    for _ in range(0, ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    flat = tl.reshape(comb, [BLOCK_T, NN])
    tl.store(comb_ptr + t.to(tl.int64)[:, None] * NN + jj[None, :], flat, mask=tmask[:, None])
    if COLLAPSE:
        k = tl.arange(0, N)
        # pre as [BT, N]: pick column k of the padded [BT, 16] tile by a masked sum.
        pick = k[None, :, None] == j[None, None, :]
        pre_k = tl.sum(tl.where(pick, pre[:, None, :], 0.0), axis=2)                  # [BT, N]
        inv = tl.full([BLOCK_T], 1.0, tl.float32)
        if NORM:  # pass 1: the RMS of the collapsed (rounded) vector; pass 2 recomputes it
            ss = tl.zeros([BLOCK_T], tl.float32)
            for d0 in range(0, D, CH):
                y = _collapse_chunk(streams_ptr, rows, pre_k, k, d0, tmask, D, CH, BF16)
                ss += tl.sum(y * y, axis=1)
            inv = tl.math.rsqrt(ss / D + norm_out_eps)
        for d0 in range(0, D, CH):
            d = d0 + tl.arange(0, CH)
            y = _collapse_chunk(streams_ptr, rows, pre_k, k, d0, tmask, D, CH, BF16)
            if NORM:
                y = tl.load(norm_ptr + d).to(tl.float32)[None, :] * (y * inv[:, None])
            tl.store(out_ptr + t.to(tl.int64)[:, None] * D + d[None, :], kv_codec.cast(y, out_ptr.dtype.element_ty),
                     mask=tmask[:, None])


@triton.jit
def _collapse_chunk(streams_ptr, rows, pre_k, k, d0, tmask, D: tl.constexpr, CH: tl.constexpr, BF16: tl.constexpr):
    """Σ_k pre_k · H_k over channels [d0, d0 + CH), rounded to the streams' dtype: [BT, CH] fp32."""
    d = d0 + tl.arange(0, CH)
    off = rows[:, :, None] + (k[None, :, None] * D + d[None, None, :])
    h = tl.load(streams_ptr + off, mask=tmask[:, None, None], other=0.0)
    y = tl.sum(pre_k[:, :, None] * h.to(tl.float32), axis=1)
    if BF16:
        y = kv_codec.round_bf16(y)
    return y


def mhc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
            hc_eps: float, norm_eps: float, collapse: bool = False, precision: str = "ieee",
            norm_weight: torch.Tensor | None = None, out_eps: float = 1e-6) -> tuple[torch.Tensor, ...]:
    """(pre, post, comb) as engine.v4.layers.hc_mix_weights, plus hc_collapse(streams, pre) if ``collapse``,
    passed through rms_norm(·, norm_weight, out_eps) when ``norm_weight`` is given (the block's
    attn_norm / ffn_norm)."""
    _check(streams, fn, base, scale)
    if norm_weight is not None and (not collapse or norm_weight.shape != (streams.shape[-1],)):
        raise ValueError("norm_weight [D] needs collapse=True")
    t, n, d = streams.shape
    if n * n < 16 or n & (n - 1):
        raise ValueError(f"mhc_mix needs n a power of two with n·n >= 16, got n={n}")
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    ch = min(64, triton.next_power_of_2(d))
    if d % ch:
        raise ValueError(f"D must be a multiple of {ch}, got {d}")
    dev = streams.device
    pre = torch.empty(t, n, dtype=torch.float32, device=dev)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=dev)
    out = torch.empty(t, d, dtype=streams.dtype, device=dev) if collapse else pre
    block_t = 16
    _mhc_mix_kernel[(triton.cdiv(max(t, 1), block_t),)](
        streams.contiguous(), fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous(), pre,
        post, comb, out, norm_weight if norm_weight is not None else pre, t, sinkhorn_iters, hc_eps, norm_eps, out_eps,
        N=n, D=d, BLOCK_T=block_t, CH=ch, COLLAPSE=collapse, NORM=norm_weight is not None,
        BF16=streams.dtype == torch.bfloat16, PRECISION=precision)
    return (pre, post, comb, out) if collapse else (pre, post, comb)


