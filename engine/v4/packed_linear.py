"""Projections of one input run as one GEMM: their weights concatenated along N.

A decode step applies several projections to the same activation (wq_a, wkv and the
compressors' wkv/wgate to x; wq_b and the indexer's wq_b to q_res; the shared expert's w1 and
w3). Each is a GEMM launch and a read of the activation; packed, they are one. Members are
grouped in order into runs of one storage format whose scales can be stacked (dense: always;
fp8: every member's N a multiple of the scale block's rows; fp4: scales are per row), so a
packed group computes exactly what its members compute. The members' weights then become views
of the packed storage: packing costs no memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..linear import Linear


def _stackable(a: Linear, b: Linear) -> bool:
    """Whether b's rows can follow a's in one weight of a's format."""
    if a.fmt != b.fmt or a.in_features != b.in_features or a.lead or b.lead or type(a) is not type(b):
        return False
    if a.weight.dtype != b.weight.dtype or a.weight.device != b.weight.device:
        return False
    if a.fmt.kind == "fp8":
        return a.out_features % a.fmt.block[0] == 0
    return True


def _pack(members: list[Linear]) -> Linear:
    first = members[0]
    packed = Linear(first.in_features, sum(m.out_features for m in members))
    packed.set_format(first.fmt)
    with torch.no_grad():
        packed.weight = nn.Parameter(torch.cat([m.weight for m in members]), requires_grad=False)
        if first.fmt.quantized:
            packed.scale = nn.Parameter(torch.cat([m.scale for m in members]), requires_grad=False)
    row = srow = 0
    for m in members:  # members now view the packed storage
        n = m.out_features
        m.weight = nn.Parameter(packed.weight[row : row + n], requires_grad=False)
        if m.scale is not None:
            rows = m.scale.shape[0]
            m.scale = nn.Parameter(packed.scale[srow : srow + rows], requires_grad=False)
            srow += rows
        row += n
    return packed


class PackedLinear:
    """`x → [m(x) for m in members]` with one GEMM per stackable run of members."""

    def __init__(self, members: Sequence[Linear]):
        self.widths = [m.out_features for m in members]
        self.groups: list[tuple[Linear, int]] = []  # (GEMM, members it covers)
        run: list[Linear] = []
        for m in members:
            if run and not _stackable(run[-1], m):
                self._close(run)
                run = []
            run.append(m)
        if run:
            self._close(run)

    def _close(self, run: list[Linear]) -> None:
        self.groups.append((run[0] if len(run) == 1 else _pack(run), len(run)))

    @property
    def num_gemms(self) -> int:
        return len(self.groups)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, K] → one [T, N_i] tensor per member (column views of a packed output)."""
        outs: list[torch.Tensor] = []
        i = 0
        for gemm, count in self.groups:
            y = gemm(x)
            widths = self.widths[i : i + count]
            outs.extend(y.split(widths, dim=-1) if count > 1 else [y])
            i += count
        return outs
