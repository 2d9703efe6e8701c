"""Quantized CPU weights prepared once for the decode-sized products a step makes many of.

The generic entry points (kernels.fp8_linear, kernels.fp4_grouped_mm, ...) re-check and re-view
every argument on every call: the backend choice, shapes and dtypes, the scales, the offsets,
numpy views of the codes, the task split. On a batch-1 decode step of the tiny V4 that cost more
than the kernels: on an AMD EPYC (Zen 4, one thread) a 128x256 FP8 `Linear` call took ~32 us
against ~6 us for the numba kernel it runs, an FP4 expert stack's grouped call ~110 us against
~38 us. A `PreparedQuantWeight` checks the weight and its scales once, keeps their numpy views
(which alias the tensors' storage, so in-place updates such as a weight reload stay visible),
and per call checks only the activation, allocates the output and runs the fused row kernel of
kernels/cpu_quant_gemm.py: the same kernels with the same arguments, so its results are the
generic path's bit for bit. Products past the fused kernels' row limits, and inputs it does not
take (`takes`), are the generic path's.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels import checks, cpu_quant_gemm as q
from kernels.reference import ACT_GROUP


class PreparedQuantWeight:
    """One CPU FP8 weight (e4m3 [N, K], scales per (bN, bK) block) or packed FP4 weight ([N, K/2],
    scales per row and `group` columns), or a stack of them [E, N, ...] for grouped products."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, kind: str, block: tuple[int, int]):
        if kind not in ("fp8", "fp4"):
            raise ValueError(f"prepare_quant_weight: kind must be 'fp8' or 'fp4', got {kind!r}")
        if not (weight.is_cpu and scale.is_cpu):
            raise ValueError("prepare_quant_weight: the weight and its scales must be CPU tensors")
        self.kind, self.block = kind, (int(block[0]), int(block[1]))
        self.grouped_weight = weight.dim() == 3
        self.n = weight.shape[-2]
        self.k = weight.shape[-1] * (2 if kind == "fp4" else 1)
        offsets = torch.zeros(weight.shape[0], dtype=torch.int32) if self.grouped_weight else None
        empty = torch.empty(0, self.k)
        if kind == "fp8":
            checks.check_fp8_gemm("prepare_quant_weight", empty, weight, scale, self.block, offsets, None, ACT_GROUP)
            self.max_rows = q.GEMV_MAX_ROWS
        else:
            checks.check_fp4_gemm("prepare_quant_weight", empty, weight, scale, self.block[1], offsets, None,
                                  ACT_GROUP)
            self.max_rows = q.FP4_GEMV_MAX_ROWS
        self.weight, self.scale = weight, scale            # for the generic path past max_rows
        self.codes, self.scales = q._np(weight), q._np(scale)
        self._key = self.key(weight, scale)

    @staticmethod
    def key(weight: torch.Tensor, scale: torch.Tensor) -> tuple:
        """What the numpy views depend on: the storage addresses and the shapes."""
        return weight.data_ptr(), scale.data_ptr(), weight.shape, scale.shape, weight.dtype, scale.dtype

    def views(self, weight: torch.Tensor, scale: torch.Tensor) -> bool:
        """Whether this preparation still views these tensors (False once either was replaced)."""
        return self._key == self.key(weight, scale)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x [M, K] goes through the prepared path: a contiguous fp32 CPU matrix of this
        weight's K columns, outside autograd. (Row limits are per call: see `linear`.)"""
        return (x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.shape[1] == self.k
                and x.is_contiguous() and not (x.requires_grad and torch.is_grad_enabled()))

    # ---- products ------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [M, K] (`takes(x)`) @ dequant(W)^T -> fp32 [M, N]; W one matrix."""
        m = x.shape[0]
        if not 0 < m <= self.max_rows:
            if self.kind == "fp8":
                return q.fp8_linear(x, self.weight, self.scale, self.block, out_dtype=torch.float32)
            return q.fp4_linear(x, self.weight, self.scale, out_dtype=torch.float32, group=self.block[1])
        out = torch.empty(m, self.n)                        # [M, N]
        per = q._rows_per_task(self.n)
        if self.kind == "fp8":
            q._fp8_gemv(self.codes, self.scales, self.block[0], self.block[1], x.numpy(), out.numpy(), per)
        else:
            q._fp4_gemv(self.codes, self.scales, self.block[1], *q._split_columns(x), out.numpy(), per)
        return out

    def grouped(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Rows [ends[e-1], ends[e]) of x fp32 [S, K] (`takes(x)`) through expert e -> fp32 [S, N];
        ends int32/int64 [E] cumulative slot counts (rows past ends[-1] are zero). Experts with
        up to max_rows rows go through one fused call, any with more through the tiled path."""
        s, num_experts = x.shape[0], self.codes.shape[0]
        if ends.dim() != 1 or ends.shape[0] != num_experts or ends.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"grouped product: ends must be int32 [{num_experts}], got {ends.dtype} "
                             f"{tuple(ends.shape)}")
        out = torch.zeros(s, self.n)                        # [S, N]
        if s == 0:
            return out
        ends_np = ends.to(torch.int64).numpy()              # int32 ends would compile a second variant
        per = q._rows_per_task(self.n * min(s, num_experts))  # at most min(S, E) experts have rows
        if self.kind == "fp8":
            heavy = q._fp8_grouped_gemv(self.codes, self.scales, self.block[0], self.block[1], x.numpy(), ends_np,
                                        self.max_rows, out.numpy(), per)
        else:
            heavy = q._fp4_grouped_gemv(self.codes, self.scales, self.block[1], *q._split_columns(x), ends_np,
                                        self.max_rows, out.numpy(), per)
        if heavy < 0:
            raise ValueError(f"grouped product: ends must be non-decreasing cumulative ends within [0, {s}], "
                             f"got {ends.tolist()}")
        if heavy:
            self._heavy_experts(x, ends_np, out)
        return out

    def _heavy_experts(self, x: torch.Tensor, ends: np.ndarray, out: torch.Tensor) -> None:
        """The experts with more than max_rows rows, one tiled product each (as the generic path)."""
        start = 0
        for e, end in enumerate(ends.tolist()):
            if end - start > self.max_rows:
                rows = x[start:end]
                if self.kind == "fp8":
                    out[start:end] = q._fp8_mm(rows, self.weight[e], self.scale[e], self.block)
                else:
                    out[start:end] = q._fp4_mm(rows, self.weight[e], self.scale[e], self.block[1])
            start = end
