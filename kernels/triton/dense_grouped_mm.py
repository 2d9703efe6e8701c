"""Grouped GEMM over dense (unquantized) MoE expert weights, without a host sync.

Semantics are F.grouped_mm(x [S, K], weight.transpose(1, 2) [E, K, N], offs=offsets int32 [E]):
rows [offsets[e-1], offsets[e]) of x go through expert e (offsets[-1] before expert 0 is 0), and
rows at or past offsets[-1] (an expert-parallel all-to-all's padding) are zero here, where torch
leaves them unwritten. Why not torch: on CUDA its grouped GEMM has a kernel only for bf16 on
sm90/sm100; every other dtype or GPU takes a fallback that copies the offsets to the host and
loops over the experts, a sync that a CUDA graph capture (the static decode step) cannot hold.

Tiling: a grid of (M tiles, N tiles); each program owns a BM x BN output tile and walks K in BK
steps, accumulating ``tl.dot`` in fp32. The weight tile [BK, BN] is read from weight[e] [N, K]
through its strides, so any layout works (the engine's GPU stacks are row-major [E, N, K]).
The M axis has cdiv(S, BM) + E programs, an upper bound that needs no offsets on the host: each
program scans the offsets itself (one vector load and a cumsum over E) to find its tile. Tiles are
numbered in expert order, cdiv(count_e, BM) per expert, then cdiv(S - offsets[-1], BM) tiles of
the rows past offsets[-1] (stored as zeros, no K loop); a program past those stores nothing.
(Over E + 1 groups that partition S rows, the sum of cdiv(count, BM) is at most cdiv(S, BM) + E.)
Every output row is written by exactly one tile, so the output needs no zero fill. Offsets are
clamped to [0, S]: invalid ones (decreasing, or past S; not checked on CUDA) give wrong rows,
never an out-of-bounds access.

Dot precision: fp32 inputs take fp32 "ieee" operands (never TF32: an fp32 model keeps fp32
maths); fp16 and bf16 inputs take their own dtype as operands; the output is x's dtype. Under
the interpreter bf16 operands are widened to fp32 first (its bf16 dot multiplies the raw bit
patterns; the products are exact in fp32 either way), and the bf16 output is rounded by bit
operations on every target (RNE, NaN -> 0x7FC0: the interpreter's cast does not round to
nearest even).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.reference import check_dense_grouped_mm

OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class Tiles:
    bm: int
    bn: int
    bk: int
    num_warps: int = 4


INTERPRET_TILES = Tiles(16, 16, 16)    # tiny, so that tests cover several tiles per expert


def gpu_tiles(rows: int, experts: int, dtype: torch.dtype) -> Tiles:
    """BM follows the mean rows per expert (decode: a few per expert; prefill: many), BK the
    operand width (fp32 tiles take twice the shared memory per element)."""
    per_expert = -(-rows // max(experts, 1))
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    return Tiles(bm, 64, 32 if dtype == torch.float32 else 64)


@triton.jit
def _tile_rows(offs_ptr, pid, num_experts, rows, E_POW2: tl.constexpr, BM: tl.constexpr):
    """(expert, first row, end row) of M tile ``pid``; expert == num_experts for the tiles of the
    rows past offsets[-1]. Past the last tile the row range is empty."""
    e = tl.arange(0, E_POW2)                                                  # [E_POW2]
    ends = tl.load(offs_ptr + e, mask=e < num_experts, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=(e >= 1) & (e < num_experts), other=0)
    ends = tl.minimum(tl.maximum(ends, 0), rows)
    starts = tl.minimum(tl.maximum(starts, 0), rows)
    tiles = (tl.maximum(ends - starts, 0) + BM - 1) // BM                    # [E_POW2], 0 past E
    last = tl.cumsum(tiles, axis=0)                                           # inclusive tile ends
    expert_tiles = tl.sum(tiles, axis=0)
    expert = tl.sum((last <= pid).to(tl.int32), axis=0)                       # first e with last[e] > pid
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, last - tiles, 0), axis=0)
    in_expert = pid < expert_tiles
    tail_start = tl.sum(tl.where(e == num_experts - 1, ends, 0), axis=0)      # offsets[-1], clamped
    row0 = tl.where(in_expert, tl.sum(tl.where(mine, starts, 0), axis=0) + (pid - first_tile) * BM,
                    tail_start + (pid - expert_tiles) * BM)
    row_end = tl.where(in_expert, tl.sum(tl.where(mine, ends, 0), axis=0), rows)
    return tl.where(in_expert, expert, num_experts), row0, row_end


@triton.jit
def _store(ptrs, v, mask, OUT_KIND: tl.constexpr):
    """Store fp32 v as fp32 (0), as bf16 bits into an int16 view (1: RNE, NaN -> 0x7FC0) or fp16 (2)."""
    if OUT_KIND == 1:
        u = v.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        tl.store(ptrs, r.to(tl.int16), mask=mask)
    elif OUT_KIND == 2:
        tl.store(ptrs, v.to(tl.float16), mask=mask)
    else:
        tl.store(ptrs, v, mask=mask)


@triton.jit
def _dense_grouped_mm_kernel(x_ptr, w_ptr, out_ptr, offs_ptr, S, N, K, num_experts,
                             stride_xs, stride_xk, stride_we, stride_wn, stride_wk, stride_os,
                             WIDEN: tl.constexpr, OUT_KIND: tl.constexpr, E_POW2: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out [S, N] tile (pid_m's rows, pid_n's columns) = x rows @ weight[expert]^T, fp32 sums."""
    expert, row0, row_end = _tile_rows(offs_ptr, tl.program_id(0), num_experts, S, E_POW2, BM)
    k_end = tl.where((expert < num_experts) & (row0 < row_end), K, 0)        # tail/empty tiles: zeros
    w_ptr += tl.minimum(expert, num_experts - 1).to(tl.int64) * stride_we
    rows = row0 + tl.arange(0, BM)                                            # [BM]
    cols = tl.program_id(1) * BN + tl.arange(0, BN)                           # [BN]
    row_ok = rows < row_end
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xs                  # [BM, 1]
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn                  # [1, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k_end, BK):
        ks = k0 + tl.arange(0, BK)                                            # [BK]
        k_ok = ks < K
        ks64 = ks.to(tl.int64)
        a = tl.load(x_rows + ks64[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_cols + ks64[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
        if WIDEN:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_os + cols[None, :]
    _store(out_ptrs, acc, row_ok[:, None] & col_ok[None, :], OUT_KIND)


# ---- launch -----------------------------------------------------------------------------------

def launch_plan(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                tiles: Tiles, interpreted: bool) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, positional args, keyword args) of the kernel launch for checked inputs (E, S, N, K
    all positive); shared by the wrapper and the compile test."""
    (s, k), (e, n, _) = x.shape, weight.shape
    grid = (triton.cdiv(s, tiles.bm) + e, triton.cdiv(n, tiles.bn))
    bf16 = x.dtype == torch.bfloat16
    args = (x, weight, out.view(torch.int16) if bf16 else out, offsets.contiguous(), s, n, k, e,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0))
    meta = dict(WIDEN=x.dtype == torch.float32 or (bf16 and interpreted), OUT_KIND=OUT_KINDS[x.dtype],
                E_POW2=triton.next_power_of_2(e), BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, num_warps=tiles.num_warps)
    return grid, args, meta


def dense_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, K] @ weight[e] [N, K]^T per expert's rows -> [S, N] in x's dtype (module docstring);
    launched on x's device and torch's current stream there, so it is capturable."""
    check_dense_grouped_mm(x, weight, offsets)
    (s, k), (e, n, _) = x.shape, weight.shape
    out = torch.empty((s, n), dtype=x.dtype, device=x.device)
    if s == 0 or n == 0:
        return out
    if e == 0 or k == 0:
        return out.zero_()                  # no expert, or empty sums: every row is zero
    tiles = gpu_tiles(s, e, x.dtype) if x.is_cuda else INTERPRET_TILES
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        grid, args, meta = launch_plan(x, weight, offsets, out, tiles, interpreted=not x.is_cuda)
        _dense_grouped_mm_kernel[grid](*args, **meta)
    return out
