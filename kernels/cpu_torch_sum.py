"""torch's CPU sum order, reproduced in numba: Σ v² of a contiguous row exactly as
``v.pow(2).sum(-1)`` (and so ``.mean()``) adds it, so the RMS statistics of the CPU decode
kernels (kernels/cpu_norm_compress.py, kernels/cpu_mhc.py) equal their torch references bit
for bit. The order (aten's cpu SumKernel): vectors of LANES, ILP interleaved accumulators, a
LEVELS-deep cascade flushed every 2^p groups, then the leftovers, the scalar tail and the lanes
left to right. LANES is probed against torch at import (8 on x86 even where AVX-512 exists: the
sum kernel is built for AVX2); an unknown build falls back to 8 and differs by fp32 ulps.

Kernels that call sum_squares carry it inlined (kernels/cpu_cache.py recompiles them when it
changes).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from kernels.cpu_numerics import F32

LEVELS = 4                  # torch's multi-row sum keeps 4 cascade levels
ILP = 4                     # and sums 4 interleaved vectors in a row reduction


@njit(cache=True, error_model="numpy")
def ceil_log2(n):
    """torch's utils::CeilLog2 (1 for n <= 2)."""
    if n <= 2:
        return 1
    k, m = 0, n - 1
    while m > 0:
        m >>= 1
        k += 1
    return k


@njit(cache=True, error_model="numpy")
def _add_squares(group, acc):
    """acc[k] += group[k]² for one group of ILP interleaved vectors (fp32 squares)."""
    for k in range(group.shape[0]):
        acc[k] += F32(group[k] * group[k])


@njit(cache=True, error_model="numpy")
def sum_squares(v, lanes, acc):
    """Σ v[j]² (fp32) in the order of torch's contiguous CPU sum of v.pow(2).

    The row is read as vectors of ``lanes``; groups of ILP consecutive vectors feed ILP
    accumulators (one per lane each) that a 4-level cascade flushes upward every 2^p groups;
    the leftover vectors join accumulator 0, the accumulators fold 0 += 1, += 2, += 3, then the
    scalar tail and the lanes are added to 0 left to right. acc: scratch [LEVELS, ILP·lanes].
    """
    n = v.shape[0]
    n_vec = n // lanes
    n_grp = n_vec // ILP
    width = ILP * lanes
    power = max(4, ceil_log2(n_grp) // LEVELS)
    step = 1 << power
    acc[:, :width] = F32(0.0)
    a0 = acc[0]
    i = 0
    while i + step <= n_grp:
        for _ in range(step):
            _add_squares(v[i * width:(i + 1) * width], a0)
            i += 1
        for lev in range(1, LEVELS):
            for k in range(width):
                acc[lev, k] += acc[lev - 1, k]
                acc[lev - 1, k] = F32(0.0)
            if i & ((step - 1) << (lev * power)):
                break
    while i < n_grp:
        _add_squares(v[i * width:(i + 1) * width], a0)
        i += 1
    for lev in range(1, LEVELS):
        for k in range(width):
            a0[k] += acc[lev, k]
    for j in range(n_grp * ILP, n_vec):
        for k in range(lanes):
            a0[k] += F32(v[j * lanes + k] * v[j * lanes + k])
    for p in range(1, ILP):
        for k in range(lanes):
            a0[k] += a0[p * lanes + k]
    total = F32(0.0)
    for j in range(n_vec * lanes, n):
        total += F32(v[j] * v[j])
    for k in range(lanes):
        total += a0[k]
    return total


def _torch_lanes() -> int:
    """The vector width of torch's CPU sum kernel here (8 even on AVX512 machines, whose sum
    kernel is built for AVX2): the one whose summation order reproduces torch on a probe."""
    probe = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 3      # [rows, D]
    want, rows = probe.pow(2).sum(-1).numpy(), probe.numpy()
    acc = np.empty((LEVELS, ILP * 16), dtype=np.float32)
    for lanes in (8, 16, 4):
        if all(sum_squares(rows[i], lanes, acc) == want[i] for i in range(rows.shape[0])):
            return lanes
    return 8                                  # unknown build: results then differ by fp32 ulps


LANES = _torch_lanes()
