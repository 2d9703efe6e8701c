"""fp32 GEMV on CPU for decode-sized products: y = x W^T with x [M, K], M <= DENSE_GEMV_MAX_ROWS.

A decode step's dense projections (the LM head, the compressors' and indexer's packed
projections) multiply one to a few rows by a weight read from memory once. torch's sgemm (MKL)
is built for reuse, not for that stream: on an AMD EPYC (Zen 4, one thread) an fp32 [8192, 256]
weight read from memory ran at 5.5-6.5 GB/s through `F.linear` at M = 1, against ~23 GB/s for a
loop that dots one weight row at a time with every activation row (perf/bench_dense_gemv.py).
Here each weight row is read once and dotted with the M activation rows while it is in L1; the
sums are fp32 with reassociation (LLVM vectorises along K) and FMA contraction, never nnan/ninf,
so NaN and Inf propagate. Rows are split into parallel tasks like the quantized GEMVs.

Larger M goes to torch (register-blocked sgemm wins there), with bf16 operands where
kernels/cpu_precision.py allows them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from numba import get_num_threads, njit, prange

from kernels.cpu_numerics import F32, U32, bits_f32, borrow
from kernels.cpu_precision import bf16_operands

# Activation rows up to which the row kernel beats sgemm on a weight streamed from memory. At 4
# rows each weight element still feeds four FMAs from L1; sgemm's blocking pays off past that.
DENSE_GEMV_MAX_ROWS = 4
ROWS_PER_TASK = 64
TASKS_PER_THREAD = 4
_DOT_MATH = {"reassoc", "contract"}


@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH)
def _dot_rows(w, a, r0, r1, out):
    """out[i, r] = w[r] · a[i] for weight rows [r0, r1) and every activation row i."""
    k = w.shape[1]
    for r in range(r0, r1):
        for i in range(a.shape[0]):
            acc = F32(0)
            for j in range(k):
                acc += w[r, j] * a[i, j]
            out[i, r] = acc


@njit(parallel=True, cache=True, error_model="numpy")
def _gemv(w_arg, a_arg, out_arg, per):
    """out [M, N] = a [M, K] @ w [N, K]^T, fp32, weight rows in tasks of `per`."""
    w, a, out = borrow(w_arg), borrow(a_arg), borrow(out_arg)
    n = w.shape[0]
    for task in prange((n + per - 1) // per):
        _dot_rows(w, a, task * per, min(n, (task + 1) * per), out)


@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH)
def _dot_rows_bf16(w, a, r0, r1, out):
    """_dot_rows on a weight held as bf16 bits (uint16 [N, K]): half the bytes of its fp32 copy,
    the same products when the fp32 weight is bf16-exact (a bf16 checkpoint's)."""
    k = w.shape[1]
    for r in range(r0, r1):
        for i in range(a.shape[0]):
            acc = F32(0)
            for j in range(k):
                acc += bits_f32(U32(U32(w[r, j]) << U32(16))) * a[i, j]
            out[i, r] = acc


@njit(parallel=True, cache=True, error_model="numpy")
def _gemv_bf16(w_arg, a_arg, out_arg, per):
    """out [M, N] = a [M, K] @ bf16 w [N, K]^T in fp32, weight rows in tasks of `per`."""
    w, a, out = borrow(w_arg), borrow(a_arg), borrow(out_arg)
    n = w.shape[0]
    for task in prange((n + per - 1) // per):
        _dot_rows_bf16(w, a, task * per, min(n, (task + 1) * per), out)


def bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The bf16 bits (uint16, same shape) of an fp32 weight whose every value is a bf16, or None."""
    half = weight.detach().to(torch.bfloat16)
    if not torch.equal(half.float(), weight.detach()):
        return None
    return half.view(torch.uint16)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether dense_linear runs the row kernel for this product (else torch's F.linear)."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and 0 < x.numel() // max(x.shape[-1], 1) <= DENSE_GEMV_MAX_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))  # training: autograd


def dense_linear(x: torch.Tensor, weight: torch.Tensor, allow_bf16: bool = True) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype, for CPU tensors. allow_bf16=False
    keeps torch's products exact fp32 whatever kernels/cpu_precision.py allows (the router)."""
    if not takes(x, weight):
        if not allow_bf16:
            return F.linear(x, weight)
        with bf16_operands(x.numel() * weight.shape[0]):           # M·K·N
            return F.linear(x, weight)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"dense_linear: x has {x.shape[-1]} features, the weight {weight.shape[1]}")
    flat = x.reshape(-1, x.shape[-1]).contiguous()                 # [M, K]
    n = weight.shape[0]
    out = torch.empty(flat.shape[0], n)                            # [M, N]
    per = max(ROWS_PER_TASK, -(-n // (TASKS_PER_THREAD * get_num_threads())))
    _gemv(weight.detach().numpy(), flat.detach().numpy(), out.numpy(), per)
    return out.view(*x.shape[:-1], n)
