"""The compiled CPU step's projections (kernels/cpu_step.py): one row of an int64 table describes a
weight, and `linear` / `grouped` run the row kernel its format has, serially or through the
parallel kernel.

The kernels are the decode path's own, called with the same arguments, so a product equals
what engine/linear.py computes through kernels/cpu_prepared_gemm.py (FP8 / FP4) or
kernels/cpu_gemv.py (dense) bit for bit: every output element is one weight row dotted with
one activation row in an order that depends on neither the row count nor the task split. What
changes is only that the row kernels serve every row count the step has (up to
kernels/cpu_step_plan.MAX_ROWS); the op path hands products past their row limits to torch's
sgemm, whose sums run in another order (fp32 ulps).

A descriptor row: kind (DENSE, FP8, FP4; DENSE_BF16: a dense fp32 weight whose values are all
bf16, read from a bf16 copy at half the bytes; for stacks also DENSE_T, a dense stack stored so
that its [E, K, N] transpose is contiguous, as engine/linear.py lays dense experts out on CPU),
the weight's and the scales' indices in the step's array lists, the scale block (FP8: bN × bK; FP4: 1 × group), N, K, and `per`: 0 runs the kernel
body on the calling thread (a parallel launch costs ~3 µs even on one thread, more than a small
product), > 0 runs the parallel kernel with `per` weight rows a task.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels import cpu_gemv
from kernels import cpu_quant_gemm as q

DENSE, FP8, FP4, DENSE_T, DENSE_BF16 = 0, 1, 2, 3, 4
KIND, W, S, BN, BK, N, K, PER = range(8)
COLUMNS = 8


@njit(cache=True, error_model="numpy")
def split_columns(a):
    """a [M, K] -> (even, odd) columns, each [M, K/2]: the FP4 kernels' activations."""
    m, half = a.shape[0], a.shape[1] // 2
    even, odd = np.empty((m, half), np.float32), np.empty((m, half), np.float32)
    for i in range(m):
        for j in range(half):
            even[i, j] = a[i, 2 * j]
            odd[i, j] = a[i, 2 * j + 1]
    return even, odd


@njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _dense_t_rows(wt, a, out):
    """out [M, N] = a [M, K] @ wt [K, N]: each output row a sum over k in order (fused
    multiply-adds, vectorised along N), so a row does not depend on the others."""
    for i in range(a.shape[0]):
        o = out[i]
        o[:] = 0.0
        for k in range(wt.shape[0]):
            v = a[i, k]
            w = wt[k]
            for n in range(o.shape[0]):
                o[n] += v * w[n]


@njit(cache=True, error_model="numpy")
def linear(desc, i, x, out, arrays):
    """out [M, N] = x [M, K] @ W^T for descriptor row i (W in f2 when dense, in h2 as bf16 bits,
    codes in u2; `arrays`: the step's lists, kernels/cpu_step_layout.py)."""
    f2, u2, h2 = arrays[1], arrays[3], arrays[6]
    kind, n, per = desc[i, KIND], desc[i, N], desc[i, PER]
    if kind == DENSE_BF16:                          # two branches: the lists hold different dtypes
        cpu_gemv._product(h2[desc[i, W]], x, out, per)
    elif kind == DENSE:
        cpu_gemv._product(f2[desc[i, W]], x, out, per)
    elif kind == FP8:
        codes, scales = u2[desc[i, W]], u2[desc[i, S]]
        if per:
            q._fp8_gemv(codes, scales, desc[i, BN], desc[i, BK], x, out, per)
        else:
            q._fp8_rows(codes, scales, desc[i, BN], desc[i, BK], 0, n, x, out)
    else:
        packed, scales = u2[desc[i, W]], u2[desc[i, S]]
        even, odd = split_columns(x)
        if per:
            q._fp4_gemv(packed, scales, desc[i, BK], even, odd, out, per)
        else:
            half = packed.shape[1]
            q._fp4_dot_rows(packed, scales, 0, n, desc[i, BK], even, odd, np.empty(half, np.float32),
                            np.empty(half, np.float32), out)


@njit(cache=True, error_model="numpy")
def grouped(desc, i, a, ends, out, arrays):
    """Rows [ends[e-1], ends[e]) of a [S, K] through expert (or group) e of descriptor row i's
    stack: out [S, N]. Every expert with rows runs the row kernel, however many rows it has;
    returns -1 when ends are not non-decreasing within [0, S] (nothing done), else 0."""
    f3, u3, h3 = arrays[2], arrays[4], arrays[7]
    kind, n, per = desc[i, KIND], desc[i, N], desc[i, PER]
    active, first, bad = q._active_experts(ends, a.shape[0] + 1, a.shape[0])
    if bad < 0:
        return -1
    if kind == DENSE_BF16:
        wb = h3[desc[i, W]]
        for t in range(active.shape[0]):
            e = active[t]
            cpu_gemv._dot_rows(wb[e], a[first[t]:ends[e]], 0, n, out[first[t]:ends[e]])
    elif kind == DENSE or kind == DENSE_T:
        w = f3[desc[i, W]]
        for t in range(active.shape[0]):
            e = active[t]
            if kind == DENSE:
                cpu_gemv._dot_rows(w[e], a[first[t]:ends[e]], 0, n, out[first[t]:ends[e]])
            else:
                _dense_t_rows(w[e], a[first[t]:ends[e]], out[first[t]:ends[e]])
    elif kind == FP8:
        codes, scales = u3[desc[i, W]], u3[desc[i, S]]
        if per:
            q._fp8_grouped_gemv(codes, scales, desc[i, BN], desc[i, BK], a, ends, a.shape[0] + 1, out, per)
        else:
            for t in range(active.shape[0]):
                e = active[t]
                q._fp8_rows(codes[e], scales[e], desc[i, BN], desc[i, BK], 0, n, a[first[t]:ends[e]],
                            out[first[t]:ends[e]])
    else:
        packed, scales = u3[desc[i, W]], u3[desc[i, S]]
        even, odd = split_columns(a)
        if per:
            q._fp4_grouped_gemv(packed, scales, desc[i, BK], even, odd, ends, a.shape[0] + 1, out, per)
        else:
            half = packed.shape[2]
            w_even, w_odd = np.empty(half, np.float32), np.empty(half, np.float32)
            for t in range(active.shape[0]):
                e = active[t]
                q._fp4_dot_rows(packed[e], scales[e], 0, n, desc[i, BK], even[first[t]:ends[e]],
                                odd[first[t]:ends[e]], w_even, w_odd, out[first[t]:ends[e]])
    return 0
