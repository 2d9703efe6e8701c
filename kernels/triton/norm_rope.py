"""Per-head RMSNorm + interleaved RoPE (+ an optional KV-record store) in one pass.

The decode step normalises and rotates several projections before attention, and rotates the
attention output back; in torch each is ~10 small ops. Here one program owns one (token, head)
vector of D values and does, in the rounding order of engine/v4/layers.py:
  PRE_ROUND   x = round(x)                          (out.to(dtype) before the inverse rope)
  NORM 1      y = round(w · (x · r))                rms_norm: fp32 statistics and product
  NORM 2      y = round(x · round(r))               head_rms_norm: the factor cast first
  rope        the last ROPE channels, pairs (2i, 2i+1): (e·c − o·s, o·c + e·s) in fp32, rounded
              (inverse: s → −s)
with r = rsqrt(mean(x²) + eps) and round() the output dtype's rounding. With a pool, the result
is also written as the record of slot[t] (−1 skips) in the pool's format (kv_codec.store_record),
which is the decode step's window write.
Layouts: x [T, H, D] with strides (row, head, 1) (a column slice of a wider GEMM output is fine);
weight [D]; cos/sin [T, ROPE / 2]; out [T, H, D] contiguous. D a power of two >= 16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import kv_codec
from kernels.decode_reference import check_norm_rope as _check
from kernels.decode_reference import norm_rope_reference  # noqa: F401 (re-exported)

_BF16 = {torch.float32: False, torch.bfloat16: True}


@triton.jit
def _round(x, BF16: tl.constexpr):
    if BF16:
        x = kv_codec.round_bf16(x)
    return x


@triton.jit
def _norm_rope_kernel(x_ptr, stride_t, stride_h, w_ptr, cos_ptr, sin_ptr, out_ptr, H, eps, slot_ptr, pool,
                      D: tl.constexpr, ROPE: tl.constexpr, HG: tl.constexpr, NORM: tl.constexpr,
                      PRE_ROUND: tl.constexpr, INVERSE: tl.constexpr, BF16: tl.constexpr, STORE: tl.constexpr,
                      FMT: tl.constexpr, R: tl.constexpr, REC: tl.constexpr, DATA: tl.constexpr,
                      SCALES: tl.constexpr, NOPE: tl.constexpr, GROUP: tl.constexpr, NSCALES: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    NG: tl.constexpr = D // (2 * HG)
    pair = tl.arange(0, NG)[:, None] * HG + tl.arange(0, HG)[None, :]            # [NG, HG]
    base = x_ptr + t.to(tl.int64) * stride_t + h.to(tl.int64) * stride_h
    xe = tl.load(base + 2 * pair).to(tl.float32)
    xo = tl.load(base + 2 * pair + 1).to(tl.float32)
    if PRE_ROUND:
        xe = _round(xe, BF16)
        xo = _round(xo, BF16)
    if NORM != 0:
        ss = tl.sum(tl.sum(xe * xe, axis=1), axis=0) + tl.sum(tl.sum(xo * xo, axis=1), axis=0)
        r = tl.math.rsqrt(ss / D + eps)
        if NORM == 1:
            xe = _round(tl.load(w_ptr + 2 * pair).to(tl.float32) * (xe * r), BF16)
            xo = _round(tl.load(w_ptr + 2 * pair + 1).to(tl.float32) * (xo * r), BF16)
        else:
            r = _round(r, BF16)
            xe = _round(xe * r, BF16)
            xo = _round(xo * r, BF16)
    if ROPE > 0:
        i = pair - (D - ROPE) // 2                                                  # rope pair (< 0: untouched)
        is_rope = i >= 0
        c = tl.load(cos_ptr + t.to(tl.int64) * (ROPE // 2) + i, mask=is_rope, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t.to(tl.int64) * (ROPE // 2) + i, mask=is_rope, other=0.0).to(tl.float32)
        if INVERSE:
            s = -s
        ye = tl.where(is_rope, _round(xe * c - xo * s, BF16), xe)
        yo = tl.where(is_rope, _round(xo * c + xe * s, BF16), xo)
    else:
        ye = xe
        yo = xo
    obase = out_ptr + (t.to(tl.int64) * H + h) * D
    tl.store(obase + 2 * pair, kv_codec.cast(ye, out_ptr.dtype.element_ty))
    tl.store(obase + 2 * pair + 1, kv_codec.cast(yo, out_ptr.dtype.element_ty))
    if STORE:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            kv_codec.store_record(pool, slot, ye, yo, D, HG, FMT, R, REC, DATA, SCALES, NOPE, NSCALES)


def norm_rope(x: torch.Tensor, norm: int = 0, weight: torch.Tensor | None = None, eps: float = 1e-6,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, inverse: bool = False,
              dtype: torch.dtype | None = None, pre_round: bool = False, pool: torch.Tensor | None = None,
              pool_fmt: str = "fp32", slots: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H, D] -> [T, H, D] in ``dtype`` (default x.dtype); see the module docstring.

    ``dtype`` is the compute dtype whose rounding the maths follows (fp32 or bf16). With ``pool``
    the results are also stored at ``slots`` [T] (−1 skips) in ``pool_fmt``.
    """
    _check(x, weight, norm, cos, sin, slots)
    t, h, d = x.shape
    kv_codec.check_dim(d)
    dtype = x.dtype if dtype is None else dtype
    if dtype not in _BF16:
        raise ValueError(f"dtype must be fp32 or bf16, got {dtype}")
    if pool is not None and h != 1:
        raise ValueError("a pool store takes one vector per token (H = 1)")
    pre_round = pre_round or x.dtype != dtype
    rope = 0 if cos is None else 2 * cos.shape[-1]
    out = torch.empty(t, h, d, dtype=dtype, device=x.device)
    if t == 0:
        return out
    store = pool is not None
    a = kv_codec.pool_args(pool, pool_fmt, d) if store else kv_codec.PoolArgs(0, 1, d, 0, 0, 0, 0, 0)
    hg = kv_codec.pair_group(a, d) if store else min(32, d // 2)
    dummy = out
    _norm_rope_kernel[(t, h)](
        x, x.stride(0), x.stride(1), weight.contiguous() if weight is not None else dummy,
        cos.float().contiguous() if rope else dummy, sin.float().contiguous() if rope else dummy, out, h, eps,
        slots.contiguous() if store else dummy, pool if store else dummy, D=d, ROPE=rope, HG=hg, NORM=norm,
        PRE_ROUND=pre_round, INVERSE=inverse, BF16=_BF16[dtype], STORE=store, NSCALES=a.num_scales,
        **kv_codec.pool_constexprs(a))
    return out


# ---- reference -------------------------------------------------------------------------------

