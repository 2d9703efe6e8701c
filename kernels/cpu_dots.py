"""The 4 × 4 dot-product tile the CPU decode kernels build their score passes from (attention
logits in kernels/cpu_attention.py, index scores in kernels/cpu_indexer.py): 16 running sums, so
each loaded element feeds four FMAs and LLVM vectorises along the dot's length.

Reassociation and FMA contraction only (never nnan/ninf): NaN and Inf still propagate. Kernels
calling it carry it inlined (kernels/cpu_cache.py recompiles them all when any kernel changes).
"""
from __future__ import annotations

from numba import njit

from kernels.cpu_numerics import F32

_DOT_MATH = {"reassoc", "contract"}


@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH)
def dot4x4(q0, q1, q2, q3, k0, k1, k2, k3, scale, s, h, n):
    """s[h + i, n + j] = scale · q_i · k_j for a tile of 4 rows × 4 keys: 8 loads per 16 FMAs."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = F32(0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = F32(0)
    for d in range(q0.shape[0]):
        x0, x1, x2, x3 = q0[d], q1[d], q2[d], q3[d]
        y0, y1, y2, y3 = k0[d], k1[d], k2[d], k3[d]
        a00 += x0 * y0
        a01 += x0 * y1
        a02 += x0 * y2
        a03 += x0 * y3
        a10 += x1 * y0
        a11 += x1 * y1
        a12 += x1 * y2
        a13 += x1 * y3
        a20 += x2 * y0
        a21 += x2 * y1
        a22 += x2 * y2
        a23 += x2 * y3
        a30 += x3 * y0
        a31 += x3 * y1
        a32 += x3 * y2
        a33 += x3 * y3
    s[h, n], s[h, n + 1], s[h, n + 2], s[h, n + 3] = a00 * scale, a01 * scale, a02 * scale, a03 * scale
    s[h + 1, n], s[h + 1, n + 1], s[h + 1, n + 2], s[h + 1, n + 3] = a10 * scale, a11 * scale, a12 * scale, a13 * scale
    s[h + 2, n], s[h + 2, n + 1], s[h + 2, n + 2], s[h + 2, n + 3] = a20 * scale, a21 * scale, a22 * scale, a23 * scale
    s[h + 3, n], s[h + 3, n + 1], s[h + 3, n + 2], s[h + 3, n + 3] = a30 * scale, a31 * scale, a32 * scale, a33 * scale
