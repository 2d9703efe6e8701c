"""Sinkhorn projection of mHC's comb matrices (DeepSeek-V4 and V4.1 hyper-connections).

comb [T, n, n] fp32 arrives row-softmaxed plus eps; the projection normalises the columns, then
(rows, columns) × (iters − 1), each division by (sum + eps). As torch ops that is 6 small ops
per iteration (~120 per mHC site at 20 iterations, two sites per layer), which on CPU costs a
few hundred microseconds of dispatch per site for 16 numbers per token. `sinkhorn` runs one
numba call instead for CPU tensors outside autograd; elsewhere (CUDA, training) the torch loop.

The numba kernel sums in index order, which for n ≤ 4 (the models' hc_mult is 4) is the order
of torch's CPU reductions, so its result is bit-identical to the loop there
(tests/kernels/test_sinkhorn.py); for wider n torch's vectorised row sums associate
differently (a few fp32 ulps).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch
from numba import njit

_TORCH_LOOP = ContextVar("sinkhorn_torch_loop", default=False)


@contextmanager
def torch_loop():
    """Inside: the torch loop on CPU too, as a GPU runs it (benchmarks that count a GPU's
    launches on CPU, or time the loop against the kernel)."""
    token = _TORCH_LOOP.set(True)
    try:
        yield
    finally:
        _TORCH_LOOP.reset(token)


def sinkhorn_reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The torch loop: [T, n, n] → [T, n, n], differentiable, any device."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@njit(cache=True, error_model="numpy")
def _sinkhorn_kernel(src, dst, iters, eps):  # src, dst: float32 [T, n, n]
    t, n = src.shape[0], src.shape[1]
    e = np.float32(eps)
    col = np.empty(n, np.float32)
    for i in range(t):
        c = dst[i]
        c[:, :] = src[i]
        for it in range(iters):
            if it > 0:  # rows
                for r in range(n):
                    s = np.float32(0.0)
                    for k in range(n):
                        s += c[r, k]
                    s += e
                    for k in range(n):
                        c[r, k] = c[r, k] / s
            for k in range(n):  # columns
                col[k] = np.float32(0.0)
            for r in range(n):
                for k in range(n):
                    col[k] += c[r, k]
            for k in range(n):
                col[k] += e
            for r in range(n):
                for k in range(n):
                    c[r, k] = c[r, k] / col[k]


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[T, n, n] fp32 → the projected matrices (a new tensor; the input is not changed)."""
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration, got {iters}")
    if (comb.device.type != "cpu" or comb.dtype != torch.float32 or (torch.is_grad_enabled() and comb.requires_grad)
            or _TORCH_LOOP.get()):
        return sinkhorn_reference(comb, iters, eps)
    src = comb.detach().contiguous()
    out = torch.empty_like(src)
    if src.numel():
        _sinkhorn_kernel(src.numpy(), out.numpy(), iters, eps)
    return out
