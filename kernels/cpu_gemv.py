"""fp32 GEMV on CPU for decode-sized products: y = x W^T with x [M, K], M <= DENSE_GEMV_MAX_ROWS.

A decode step's dense projections (the LM head, the compressors' and indexer's packed
projections) multiply one to a few rows by a weight read from memory once. torch's sgemm (MKL)
is built for reuse, not for that stream: on an AMD EPYC (Zen 4, one thread) an fp32 [8192, 256]
weight read from memory ran at 5.5-6.5 GB/s through `F.linear` at M = 1, against ~23 GB/s for a
loop that dots one weight row at a time with every activation row (perf/bench_dense_gemv.py).
Here each weight row is read from memory once and dotted with the M activation rows while it is
in L1 (a tile of rows at a time, `_dot_rows`); fp32 weights, bf16-exact ones read as bf16 bits,
and (for several activation rows) the FP8 GEMV's e4m3 codes share the kernel. The sums are fp32 with reassociation (LLVM vectorises along K) and FMA
contraction, never nnan/ninf, so NaN and Inf propagate. Rows are split into parallel tasks like
the quantized GEMVs.

Larger M goes to torch (register-blocked sgemm wins there), with bf16 operands where
kernels/cpu_precision.py allows them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from numba import get_num_threads, njit, prange, types
from numba.extending import overload

from kernels.cpu_numerics import F32, U32, bits_f32, borrow, e4m3_half_bits, half_value
from kernels.cpu_precision import bf16_operands

# Activation rows up to which the row kernel beats sgemm on a weight streamed from memory. At 4
# rows each weight element still feeds four FMAs from L1; sgemm's blocking pays off past that.
DENSE_GEMV_MAX_ROWS = 4
ROWS_PER_TASK = 64
TASKS_PER_THREAD = 4
TILE_BYTES = 16 << 10    # weight bytes a pass of activation rows walks (`_dot_rows`)
_DOT_MATH = {"reassoc", "contract"}


def weight_value(x):
    """A weight element as fp32, by its array's dtype: an fp32 weight's element itself; bf16 bits
    (uint16) as their float; an e4m3 code (uint8) as e4m3 / 256, the FP8 row kernels' convention
    (their activations carry the block scales × 256, kernels/cpu_quant_gemm.py)."""
    raise NotImplementedError("numba only")


@overload(weight_value, inline="always")
def _weight_value(x):
    if isinstance(x, types.Integer) and x.bitwidth == 16:
        return lambda x: bits_f32(U32(U32(x) << U32(16)))
    if isinstance(x, types.Integer) and x.bitwidth == 8:
        return lambda x: half_value(e4m3_half_bits(x))
    if isinstance(x, types.Float):
        return lambda x: x
    return None


@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH)
def _dot_rows(w, a, r0, r1, out):
    """out[i, r] = w[r] · a[i] for weight rows [r0, r1) and every activation row i; w is fp32,
    bf16 bits (uint16 [N, K]: half the bytes of the fp32 copy, the same products when that copy
    is bf16-exact, as a bf16 checkpoint's is) or e4m3 codes (`weight_value`). Four activation
    rows per pass share each weight load and decode, then two, then one; the weight rows go in
    tiles of about TILE_BYTES, each pass over a whole tile, so a pass's activation rows and the
    tile stay in L1 (without the tiles, 16 activation rows at K = 1024 came from L2 for every
    weight row). Every pass gives a sum the same vector order, so a row's result depends on
    neither the row count nor the tiling (tested). On a Zen 4, 2 threads: 1.2-1.6x the previous
    one-row-at-a-time dense loop at 4-16 rows, and on FP8 1.6-2.4x the untiled passes at 16 rows,
    on the LM heads and projections of the tiny V4s, the same bits (perf/bench_row_tiles.py)."""
    m, k = a.shape[0], w.shape[1]
    # One activation row stays in L1 anyway: a single tile, i.e. the plain loop (tiles ran
    # 0.87-0.91x there on 128- and 512-wide weights, perf/bench_row_tiles.py --rows 1).
    tile = max(1, r1 - r0) if m == 1 else max(1, TILE_BYTES // (k * w.itemsize))
    for t0 in range(r0, r1, tile):
        t1 = min(r1, t0 + tile)
        for i in range(0, m - 3, 4):
            for r in range(t0, t1):
                acc0, acc1, acc2, acc3 = F32(0), F32(0), F32(0), F32(0)
                for j in range(k):
                    x = weight_value(w[r, j])
                    acc0 += x * a[i, j]
                    acc1 += x * a[i + 1, j]
                    acc2 += x * a[i + 2, j]
                    acc3 += x * a[i + 3, j]
                out[i, r], out[i + 1, r], out[i + 2, r], out[i + 3, r] = acc0, acc1, acc2, acc3
        for i in range(m - m % 4, m - 1, 2):
            for r in range(t0, t1):
                acc0, acc1 = F32(0), F32(0)
                for j in range(k):
                    x = weight_value(w[r, j])
                    acc0 += x * a[i, j]
                    acc1 += x * a[i + 1, j]
                out[i, r], out[i + 1, r] = acc0, acc1
        if m % 2:
            for r in range(t0, t1):
                acc = F32(0)
                for j in range(k):
                    acc += weight_value(w[r, j]) * a[m - 1, j]
                out[m - 1, r] = acc


@njit(parallel=True, cache=True, error_model="numpy")
def _gemv(w_arg, a_arg, out_arg, per):
    """out [M, N] = a [M, K] @ w [N, K]^T in fp32 (w fp32 or bf16 bits, `weight_value`), weight
    rows in tasks of `per`."""
    w, a, out = borrow(w_arg), borrow(a_arg), borrow(out_arg)
    n = w.shape[0]
    for task in prange((n + per - 1) // per):
        _dot_rows(w, a, task * per, min(n, (task + 1) * per), out)


@njit(cache=True, error_model="numpy")
def _product(w, a, out, per):
    """out = a @ w^T through `_gemv` with `per` weight rows a task, or on this thread (per = 0:
    a parallel launch costs more than a small product)."""
    if per:
        _gemv(w, a, out, per)
    else:
        _dot_rows(w, a, 0, w.shape[0], out)


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
