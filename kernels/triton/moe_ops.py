"""The MoE glue around the two grouped GEMMs, one launch each: gather, activation, combine.

  gather_rows   slots[i] = x[order[i] // k]                  (tokens into expert order)
  swiglu        act = silu(min(g, L)) · clamp(u, −L, L)      (h = [g | u] per row; optional
                                                             row weight folded in: w · act)
  moe_combine   out[t] = Σ_j w[t, j] · y[inverse[t·k + j]] (+ shared[t])
Rounding follows engine/v4/moe.py and engine/v4/layers.py in the compute dtype: silu and each product
round once; the combine rounds each weighted row, sums the k choices in order in fp32, rounds,
then adds the shared expert's output and rounds again. The routing weights are fp32.
Layouts: x [T, H]; order, inverse int [T·k]; h [S, 2I]; y [S, H]; w [T, k] fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import kv_codec
from kernels.decode_reference import check_moe_combine
from kernels.decode_reference import (gather_rows_reference, moe_combine_reference,  # noqa: F401 (re-exported)
                                      swiglu_reference)


@triton.jit
def _r(x, BF16: tl.constexpr):
    if BF16:
        x = kv_codec.round_bf16(x)
    return x


@triton.jit
def _gather_rows_kernel(x_ptr, order_ptr, out_ptr, K, H, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(order_ptr + i).to(tl.int64) // K
    v = tl.load(x_ptr + src * H + c, mask=c < H)
    tl.store(out_ptr + i * H + c, v, mask=c < H)


@triton.jit
def _swiglu_kernel(h_ptr, w_ptr, out_ptr, I, limit, HAS_W: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    g = tl.load(h_ptr + s * 2 * I + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + s * 2 * I + I + c, mask=m, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    act = _r(_r(g / (1.0 + tl.exp(-g)), BF16) * u, BF16)
    if HAS_W:
        act = _r(act * _r(tl.load(w_ptr + s), BF16), BF16)
    tl.store(out_ptr + s * I + c, kv_codec.cast(act, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _combine_kernel(y_ptr, w_ptr, inv_ptr, shared_ptr, out_ptr, K, H, HAS_W: tl.constexpr,
                    HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(0, K):
        row = tl.load(inv_ptr + t * K + j).to(tl.int64)
        v = tl.load(y_ptr + row * H + c, mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            v = _r(v * _r(tl.load(w_ptr + t * K + j), BF16), BF16)
        acc += v
    acc = _r(acc, BF16)
    if HAS_SHARED:
        acc = _r(acc + tl.load(shared_ptr + t * H + c, mask=m, other=0.0).to(tl.float32), BF16)
    tl.store(out_ptr + t * H + c, kv_codec.cast(acc, out_ptr.dtype.element_ty), mask=m)


def _block(n: int) -> int:
    return min(1024, triton.next_power_of_2(max(n, 1)))


def gather_rows(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """x [T, H] -> [T·k, H]: row i is x[order[i] // k]."""
    out = torch.empty(order.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    if order.shape[0]:
        b = _block(x.shape[1])
        _gather_rows_kernel[(order.shape[0], triton.cdiv(x.shape[1], b))](x.contiguous(), order.contiguous(), out, k,
                                                                          x.shape[1], BLOCK=b)
    return out


def swiglu(h: torch.Tensor, limit: float, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """h [S, 2I] (gate | up) -> [S, I] in h.dtype, times row_weight [S] (fp32) when given."""
    s, two_i = h.shape
    out = torch.empty(s, two_i // 2, dtype=h.dtype, device=h.device)
    if s:
        b = _block(two_i // 2)
        _swiglu_kernel[(s, triton.cdiv(two_i // 2, b))](
            h.contiguous(), row_weight.float().contiguous() if row_weight is not None else h, out, two_i // 2,
            float(limit), HAS_W=row_weight is not None, BLOCK=b, BF16=h.dtype == torch.bfloat16)
    return out


def moe_combine(y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, shared: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """y [T·k, H] in expert order -> [T, H] in ``dtype``: Σ_j w[t, j] · y[inverse[t·k + j]] (+ shared)."""
    t, k = weights.shape
    check_moe_combine(y, weights, inverse)
    h = y.shape[1]
    out = torch.empty(t, h, dtype=dtype, device=y.device)
    if t:
        b = _block(h)
        _combine_kernel[(t, triton.cdiv(h, b))](
            y.contiguous(), weights.float().contiguous(), inverse.contiguous(),
            shared.contiguous() if shared is not None else y, out, k, h, HAS_W=True, HAS_SHARED=shared is not None,
            BLOCK=b, BF16=dtype == torch.bfloat16)
    return out


# ---- references ------------------------------------------------------------------------------


