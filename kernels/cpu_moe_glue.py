"""CPU (numba) MoE glue of the static decode step: `gather_rows` and `moe_combine`.

Same signatures and semantics as kernels/triton/moe_ops.py's torch references (see its
docstring for the layouts). At decode sizes the references are a few small torch ops each
(integer division and indexing; a weighted gather, a cast, a strided sum, an add), so their
cost is dispatch and temporaries; here each op is one numba loop over the output.

Numerics, against the references on CPU (tests/kernels/test_cpu_moe_glue.py):
- gather_rows copies bytes: exact for every dtype.
- moe_combine: each weighted row y · w rounds once in y's dtype (w rounded to y's dtype first,
  as ``weights.to(y.dtype)``), the k rows are summed in order in fp32 and rounded once to y's
  dtype (what torch's sum over the middle dim of size k does), then the shared expert's output
  is added and rounded again. Measured bit-exact (NaN payloads aside) for bf16, and for fp32
  when H is a multiple of 32 (every model width here); torch sums fp32 columns past the last
  full 32 (its 4 x 8-lane vector block) in another order, so those can differ by an ulp.
  bf16 tensors travel as 16-bit integers (cpu_numerics' load_bits /
  store_value); a dtype mix other than bf16 or fp32 throughout falls back to the reference.

swiglu is not ported: with numba's scalar libm expf (torch's silu uses SLEEF's vectorised exp)
a numba loop (bit-exact in bf16, <= 4 fp32 ulps) measured 2-3x slower than the reference from
T·k = 96 rows and no faster for one token (one thread, while writing this module), so
kernels/cpu_decode.py keeps the reference.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from kernels.cpu_numerics import bits_f32, borrow, load_bits, round_as, store_value
from kernels.decode_reference import check_moe_combine, gather_rows_reference, moe_combine_reference


# ---- kernels ----------------------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _gather_rows(x_arg, order_arg, k, out_arg):
    """out[i] = x[order[i] // k] (rows as raw bytes)."""
    x, order, out = borrow(x_arg), borrow(order_arg), borrow(out_arg)
    for i in range(out.shape[0]):
        src, dst = x[order[i] // k], out[i]
        for c in range(dst.shape[0]):
            dst[c] = src[c]


@njit(cache=True, error_model="numpy")
def _moe_combine(y_arg, w_arg, inverse_arg, shared_arg, has_shared, out_arg, acc_arg):
    """out[t] = round(Σ_j round(y[inverse[t·k + j]] · round(w[t, j]))) (+ shared[t], rounded)."""
    y, w, inverse, shared, out, acc = (borrow(y_arg), borrow(w_arg), borrow(inverse_arg), borrow(shared_arg),
                                       borrow(out_arg), borrow(acc_arg))
    k = w.shape[1]
    width = out.shape[1]
    for t in range(out.shape[0]):
        acc[:] = 0.0
        for j in range(k):
            row = y[inverse[t * k + j]]
            wj = round_as(y, w[t, j])
            for c in range(width):
                acc[c] += round_as(y, bits_f32(load_bits(row[c])) * wj)
        o_row = out[t]
        if has_shared:
            s_row = shared[t]
            for c in range(width):
                store_value(o_row, c, round_as(out, round_as(y, acc[c]) + bits_f32(load_bits(s_row[c]))))
        else:
            for c in range(width):
                store_value(o_row, c, round_as(y, acc[c]))


# ---- torch-facing wrappers --------------------------------------------------------------------

def _bits(x: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view: bf16 as its 16 bits (int16: load_bits / store_value / round_as only
    use the low 16 bits, so the sign extension is harmless), fp32 as is."""
    return x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def _kernel_dtype(*tensors: torch.Tensor | None) -> bool:
    dtypes = {t.dtype for t in tensors if t is not None}
    return len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float32}


def gather_rows(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """x [T, H] -> [T·k, H]: row i is x[order[i] // k]."""
    if x.dim() != 2 or order.dim() != 1:
        return gather_rows_reference(x, order, k)
    x = x.contiguous()
    out = torch.empty(order.shape[0], x.shape[1], dtype=x.dtype)
    if out.numel():
        _gather_rows(x.view(torch.uint8).numpy(), order.contiguous().numpy(), k, out.view(torch.uint8).numpy())
    return out


def moe_combine(y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, shared: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """y [T·k, H] in expert order -> [T, H] in ``dtype``: Σ_j w[t, j] · y[inverse[t·k + j]] (+ shared)."""
    t, k = weights.shape
    check_moe_combine(y, weights, inverse)
    if y.dim() != 2 or y.dtype != dtype or not _kernel_dtype(y, shared):
        return moe_combine_reference(y, weights, inverse, shared, dtype)
    out = torch.empty(t, y.shape[1], dtype=dtype)
    if out.numel():
        sh = shared.contiguous() if shared is not None else out
        _moe_combine(_bits(y.contiguous()), weights.float().contiguous().numpy(), inverse.contiguous().numpy(),
                     _bits(sh), shared is not None, _bits(out), np.empty(y.shape[1], np.float32))
    return out
