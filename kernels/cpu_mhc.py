"""CPU (numba) mHC ops of the static decode step: `mhc_mix` and `mhc_expand`, one call each.

The torch references (kernels/triton/mhc_mix.py, mhc_expand.py, i.e. engine/v4/layers.py
hc_mix_weights / hc_collapse / rms_norm / hc_expand) are ~20 small torch ops per site plus the
Sinkhorn loop: at batch 1 that is a few hundred µs of dispatch for a few thousand flops. Here a
site is one numba call; the wrappers only allocate outputs and view tensors as numpy arrays.

Numerics, against the references on CPU:
- The RMS statistics (sum of squares over n·D for the mix, over D for the block norm) are
  summed in the order of torch's CPU sum kernel (aten cpu/SumKernel.cpp: lanes of one SIMD
  vector, four vectors in flight, a cascade of partial sums every 16 steps, then the tail and
  the lanes in order: kernels/cpu_torch_sum.py), so a mean equals torch's bit for bit; rsqrt is
  1 / sqrt, as torch's vectorised rsqrt.
- The projection flat · fnᵀ is a dot of length n·D summed in whatever order LLVM vectorises it
  (``fastmath={"reassoc"}`` on that one loop; NaN/Inf semantics kept): torch's MKL sgemm has its
  own order, so pre / post / comb differ from the reference by a few fp32 ulps (the exp of
  numba vs torch's SLEEF exp adds up to one more). Per token the result does not depend on T.
- Everything after the projection is the reference's op sequence in fp32: sigmoid as
  1 / (1 + exp(-x)), softmax as exp(x - max) · (1 / sum) (torch's lastdim kernel), Sinkhorn by
  kernels/sinkhorn.py's kernel (bit-identical to the torch loop for n ≤ 4), the collapse as
  ((0 + pre_0·H_0) + pre_1·H_1) + … rounded once to the streams' dtype, the norm as
  w · (x · rsqrt(mean(x²) + eps)). Given the same pre, collapse and norm are bit-exact.
- Expand: comb and post are rounded to the streams' dtype first; the mix Σ_j c_jk·H_j is a
  chain of fused multiply-adds from j = 0 in fp32 and rounds once (what torch's CPU matmul does:
  MKL's fp32 sgemm FMA chain, the bf16 gemm's fp32 accumulator; products of two bf16 values are
  exact, so FMA or not is the same there); post·y and the final sum each round once.
  Measured: bit-exact for bf16 and for fp32 at D >= 256; torch's fp32 matmul at tiny D and its
  bf16 matmul at large batches (T=16, D=4096: ~1e-6 of the elements) take other paths whose
  sums can differ by one ulp.

The kernels here carry kernels/sinkhorn.py's, cpu_torch_sum.py's and cpu_numerics.py's jitted
code inlined (kernels/cpu_cache.py recompiles them when any of those changes).
"""
from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import decode_reference as _ref
from kernels.cpu_numerics import bits_f32, load_bits, round_as, store_value
from kernels.cpu_torch_sum import ILP, LANES, LEVELS, sum_squares
from kernels.sinkhorn import _sinkhorn_kernel

F32 = np.float32



@intrinsic
def fma32(typingctx, a, b, c):
    """a·b + c rounded once (llvm.fma.f32)."""
    if not all(isinstance(v, types.Float) for v in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
        vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
        return builder.call(fn, vals)
    return types.float32(a, b, c), codegen


@njit(cache=True, error_model="numpy")
def _ld(a, i):
    """Element i of a float32 or bf16-bits (int16) array as fp32."""
    return bits_f32(load_bits(a[i]))


@njit(cache=True, error_model="numpy", fastmath={"reassoc"})
def _dot(a, b):
    """Σ a[i]·b[i] in fp32, any association (vectorised), no FMA contraction. One token per call,
    so a token's sums do not depend on the batch it is in."""
    s = F32(0.0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@njit(cache=True, error_model="numpy")
def _sigmoid(x):
    return F32(1.0) / (F32(1.0) + np.exp(-x))


# ---- mhc_mix ---------------------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _mix_token(mix, base, scale, hc_eps, n, pre, post, comb):
    """pre [n], post [n], comb [n, n] (row-softmaxed + eps, before Sinkhorn) of one token from
    its projection mix [(2+n)·n] = fn · normalised flat streams."""
    for j in range(n):
        pre[j] = _sigmoid(mix[j] * scale[0] + base[j]) + hc_eps
        post[j] = F32(2.0) * _sigmoid(mix[n + j] * scale[1] + base[n + j])
    for r in range(n):
        row = comb[r]
        m = -np.inf
        for c in range(n):
            idx = 2 * n + r * n + c
            row[c] = mix[idx] * scale[2] + base[idx]
            m = max(m, row[c])
        s = F32(0.0)
        for c in range(n):
            row[c] = np.exp(row[c] - m)
            s += row[c]
        inv = F32(1.0) / s
        for c in range(n):
            row[c] = row[c] * inv + hc_eps


@njit(cache=True, error_model="numpy")
def _collapse_token(h, pre, n, d, x, xf):
    """x (output row [D]) = Σ_k pre_k · H_k rounded to the streams' dtype (h: the token's [n·D]
    streams); xf [D] fp32 gets the rounded values for the norm."""
    for c in range(d):
        s = F32(0.0)
        for k in range(n):
            s += pre[k] * _ld(h, k * d + c)
        store_value(x, c, s)
        xf[c] = _ld(x, c)


@njit(cache=True, error_model="numpy")
def _mix_kernel(streams, fn, base, scale, iters, hc_eps, norm_eps, collapse, norm_w, has_norm, out_eps,
                pre, post, comb, x_out, lanes):
    """streams [T, n·D] (fp32 or bf16 bits); fn [(2+n)·n, n·D] fp32; outputs pre/post [T, n],
    comb [T, n, n] fp32 and (collapse) x_out [T, D] in the streams' dtype; lanes: torch's sum
    vector width (kernels/cpu_torch_sum.py)."""
    t_count, nd = streams.shape
    n = pre.shape[1]
    d = nd // n
    rows = fn.shape[0]
    eps = F32(hc_eps)
    acc = np.empty((LEVELS, ILP * lanes), np.float32)
    flat = np.empty((t_count, nd), np.float32)                   # [T, n·D], RMS-normalised
    for t in range(t_count):
        h = streams[t]
        row = flat[t]
        for i in range(nd):
            row[i] = _ld(h, i)
        r = F32(1.0) / np.sqrt(sum_squares(row, lanes, acc) / F32(nd) + F32(norm_eps))
        for i in range(nd):
            row[i] = row[i] * r
    mix = np.empty((t_count, rows), np.float32)                  # [T, (2+n)·n]
    for r in range(rows):                                        # one fn row stays in cache
        f = fn[r]
        for t in range(t_count):
            mix[t, r] = _dot(f, flat[t])
    for t in range(t_count):
        _mix_token(mix[t], base, scale, eps, n, pre[t], post[t], comb[t])
    _sinkhorn_kernel(comb, comb, iters, hc_eps)                  # in place: it copies src[i] first
    if not collapse:
        return
    xf = np.empty(d, np.float32)                                 # [D]
    for t in range(t_count):
        x = x_out[t]
        _collapse_token(streams[t], pre[t], n, d, x, xf)
        if has_norm:
            inv = F32(1.0) / np.sqrt(sum_squares(xf, lanes, acc) / F32(d) + F32(out_eps))
            for c in range(d):
                store_value(x, c, norm_w[c] * (xf[c] * inv))


def _np(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as numpy: bf16 as its int16 bits, anything else as fp32."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    return (t if t.dtype == torch.float32 else t.float()).numpy()


def _f32(t: torch.Tensor) -> np.ndarray:
    return (t if t.dtype == torch.float32 else t.float()).detach().contiguous().numpy()


_NO_NORM = np.zeros(1, np.float32)


def mhc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
            hc_eps: float, norm_eps: float, collapse: bool = False, precision: str = "ieee",
            norm_weight: torch.Tensor | None = None, out_eps: float = 1e-6) -> tuple[torch.Tensor, ...]:
    """(pre [T, n], post [T, n], comb [T, n, n]) fp32 as engine.v4.layers.hc_mix_weights, plus the
    collapsed x [T, D] in streams.dtype when ``collapse`` (rms_norm'ed by ``norm_weight`` when
    given). ``precision`` is the Triton kernel's and ignored here."""
    _ref.check_mhc_mix(streams, fn, base, scale)
    t, n, d = streams.shape
    if norm_weight is not None and (not collapse or norm_weight.shape != (d,)):
        raise ValueError("norm_weight [D] needs collapse=True")
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    if streams.dtype not in (torch.float32, torch.bfloat16):
        return _ref.mhc_mix_reference(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, collapse, precision,
                                      norm_weight, out_eps)
    src = streams.detach().contiguous()
    pre = torch.empty(t, n, dtype=torch.float32)
    post = torch.empty(t, n, dtype=torch.float32)
    comb = torch.empty(t, n, n, dtype=torch.float32)
    x = torch.empty(t, d, dtype=streams.dtype) if collapse else None
    if t:
        _mix_kernel(_np(src).reshape(t, n * d), _f32(fn), _f32(base), _f32(scale), sinkhorn_iters, hc_eps, norm_eps,
                    collapse, _f32(norm_weight) if norm_weight is not None else _NO_NORM, norm_weight is not None,
                    out_eps, pre.numpy(), post.numpy(), comb.numpy(), _np(x) if collapse else _NO_NORM[None], LANES)
    return (pre, post, comb, x) if collapse else (pre, post, comb)


# ---- mhc_expand ------------------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _expand_kernel(streams, y, post, comb, out):
    """streams, out [T, n·D]; y [T, D] (same dtype: fp32 or bf16 bits); post [T, n], comb
    [T, n, n] fp32. out_k = r(r(post_k)·y) + r(Σ_j r(c_jk)·H_j), r = round to the dtype."""
    t_count, n = post.shape
    d = y.shape[1]
    mixed = np.empty(d, np.float32)                              # [D] fp32 accumulator
    for t in range(t_count):
        h = streams[t]
        yr = y[t]
        o = out[t]
        for k in range(n):
            mixed[:] = F32(0.0)
            for j in range(n):  # an FMA chain from j = 0, as torch's matmul accumulates
                c = round_as(out, comb[t, j, k])
                hj = h[j * d:(j + 1) * d]
                for e in range(d):
                    mixed[e] = fma32(c, _ld(hj, e), mixed[e])
            p = round_as(out, post[t, k])
            ok = o[k * d:(k + 1) * d]
            for e in range(d):
                store_value(ok, e, round_as(out, p * _ld(yr, e)) + round_as(out, mixed[e]))


def mhc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """engine.v4.layers.hc_expand(streams, y, post, comb) -> [T, n, D] in streams.dtype."""
    t, n, d = streams.shape
    if y.shape != (t, d) or post.shape != (t, n) or comb.shape != (t, n, n):
        raise ValueError(f"y must be [{t}, {d}], post [{t}, {n}], comb [{t}, {n}, {n}]; got {tuple(y.shape)}, "
                         f"{tuple(post.shape)}, {tuple(comb.shape)}")
    if streams.dtype not in (torch.float32, torch.bfloat16) or y.dtype != streams.dtype:
        return _ref.mhc_expand_reference(streams, y, post, comb)
    out = torch.empty(t, n, d, dtype=streams.dtype)
    if t:
        _expand_kernel(_np(streams.detach().contiguous()).reshape(t, n * d), _np(y.detach().contiguous()), _f32(post),
                       _f32(comb), _np(out).reshape(t, n * d))
    return out
