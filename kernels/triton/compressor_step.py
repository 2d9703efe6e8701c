"""The compressor's per-token decode step, fused: append rows, pool, norm, rope, quantize, write.

Each token of the step appends its row [C | Z + ape] (fp32, 2·width) to the sliding state pool.
A token at position p with (p + 1) % m == 0 completes entry p // m, which pools the `span` rows
ending at p: span = m (HCA: C and Z are `d` wide) or 2m (CSA, overlapping: C = [Ca | Cb], Z likewise,
each 2d wide; the entry pools Ca of the previous window's m rows and Cb of this window's m rows).
Per channel: softmax of the gates over the span (fp32; rows before position 0 have gate -inf and
kv 0), Σ kv · softmax; then RMSNorm with weight (in the compute dtype, fp32 statistics), RoPE at
position m·(p // m) on the last rope_dim channels (interleaved pairs), and the record is written in
the entry pool's format (fp8_ds_mla / fp4_kv quantized in registers, or raw).

One program per token (grid B·q). The program of a token that completes nothing only copies its
row. Layouts: rows [B, q, 2·width] fp32; state_pool fp32 [blocks, R, 2·width];
row_slots [B, span - 1 + q]: state slots of positions start - span + 1 .. start + q - 1 (-1 = the
position does not exist (< 0); the last q are where this step's rows go, -1 skips the write);
entry_slots [B, q]: the entry slot a token completes, -1 when it completes none (or is padding);
cos/sin [B, q, rope_dim / 2] at the token's entry position m·(p // m).
Cost per completing token: span·2d·4·2 bytes of rows read (kv and gate, each twice: max pass,
then weighted pass), one record written; other tokens 2·width·4 bytes copied.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import kv_codec
from kernels.decode_reference import check_compressor_step as _check
from kernels.decode_reference import compressor_geometry as _geometry
from kernels.decode_reference import compressor_step_reference  # noqa: F401 (re-exported)

_FLOAT_DTYPES = {torch.float32: False, torch.bfloat16: True}


@triton.jit
def _new_row(rows_ptr, stride, ape_ptr, pos_ptr, r, col, RATIO, WIDTH: tl.constexpr, HAS_APE: tl.constexpr, mask):
    """Row r of this step at columns `col` in fp32, [C | Z + ape[pos % m]] when the rows come raw."""
    v = tl.load(rows_ptr + r.to(tl.int64) * stride + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_APE:
        slot = tl.load(pos_ptr + r) % RATIO
        is_gate = col >= WIDTH
        v += tl.load(ape_ptr + slot * WIDTH + tl.maximum(col - WIDTH, 0), mask=mask & is_gate, other=0.0)
    return v


@triton.jit
def _row_values(rows_ptr, stride, ape_ptr, pos_ptr, state_ptr, slots_ptr, seq, idx, col, S1, Q, RATIO,
                ROW: tl.constexpr, WIDTH: tl.constexpr, HAS_APE: tl.constexpr):
    """Values at column tile `col` of window row `idx` of sequence `seq` (idx < S1: history)."""
    r = seq * Q + tl.maximum(idx - S1, 0)                         # the step's row (when not history)
    # Scalars broadcast to the tile first: masks must have the pointer's shape.
    idx = tl.zeros_like(col) + idx
    slot = tl.zeros_like(col) + tl.load(slots_ptr + seq * (S1 + Q) + tl.minimum(idx, S1 + Q - 1))
    from_pool = idx < S1
    hist = tl.load(state_ptr + tl.maximum(slot, 0).to(tl.int64) * ROW + col, mask=from_pool & (slot >= 0),
                   other=0.0)
    new = _new_row(rows_ptr, stride, ape_ptr, pos_ptr, r, col, RATIO, WIDTH, HAS_APE, idx >= S1)
    return tl.where(from_pool, hist, new), from_pool & (slot < 0)


@triton.jit
def _pool_channels(rows_ptr, stride, ape_ptr, pos_ptr, state_ptr, slots_ptr, seq, j, chan, S1, Q, RATIO, SPAN,
                   ROW: tl.constexpr, WIDTH: tl.constexpr, DIM: tl.constexpr, OVERLAP: tl.constexpr,
                   HAS_APE: tl.constexpr):
    """Softmax-gated pooling of output channels `chan` (any tile shape) for token j of `seq`."""
    gmax = tl.full(chan.shape, float("-inf"), tl.float32)
    for s in range(0, SPAN):
        off = chan
        if OVERLAP:
            off = tl.where(s >= RATIO, chan + DIM, chan)       # Cb of this window, Ca of the previous one
        gate, missing = _row_values(rows_ptr, stride, ape_ptr, pos_ptr, state_ptr, slots_ptr, seq, j + s, WIDTH + off, S1, Q,
                                     RATIO, ROW, WIDTH, HAS_APE)
        gmax = tl.maximum(gmax, tl.where(missing, float("-inf"), gate))
    total = tl.zeros(chan.shape, tl.float32)
    acc = tl.zeros(chan.shape, tl.float32)
    for s in range(0, SPAN):
        off = chan
        if OVERLAP:
            off = tl.where(s >= RATIO, chan + DIM, chan)
        kv, missing = _row_values(rows_ptr, stride, ape_ptr, pos_ptr, state_ptr, slots_ptr, seq, j + s, off, S1, Q, RATIO,
                                   ROW, WIDTH, HAS_APE)
        gate, _ = _row_values(rows_ptr, stride, ape_ptr, pos_ptr, state_ptr, slots_ptr, seq, j + s, WIDTH + off, S1, Q,
                                     RATIO, ROW, WIDTH, HAS_APE)
        e = tl.where(missing, 0.0, tl.exp(gate - gmax))
        total += e
        acc += tl.where(missing, 0.0, kv) * e
    return acc / total


@triton.jit
def _round(x, BF16: tl.constexpr):
    """The compute dtype's rounding of fp32 values (identity for fp32)."""
    if BF16:
        x = kv_codec.round_bf16(x)
    return x


@triton.jit
def _compressor_step_kernel(
        rows_ptr, stride, ape_ptr, pos_ptr, state_ptr, row_slots, entry_pool, entry_slots, norm_ptr, cos_ptr, sin_ptr,
        Q, S1, RATIO, SPAN, eps, HAS_APE: tl.constexpr, ROW: tl.constexpr, WIDTH: tl.constexpr, DIM: tl.constexpr, ROPE: tl.constexpr,
        OVERLAP: tl.constexpr, BF16: tl.constexpr, HG: tl.constexpr, FMT: tl.constexpr, R: tl.constexpr,
        REC: tl.constexpr, DATA: tl.constexpr, SCALES: tl.constexpr, NOPE: tl.constexpr, GROUP: tl.constexpr,
        NSCALES: tl.constexpr):
    row = tl.program_id(0)                                        # b·q + j
    seq = row // Q
    j = row - seq * Q
    col = tl.arange(0, ROW)
    values = _new_row(rows_ptr, stride, ape_ptr, pos_ptr, row, col, RATIO, WIDTH, HAS_APE, col < ROW)
    dst = tl.load(row_slots + seq * (S1 + Q) + S1 + j)
    if dst >= 0:
        tl.store(state_ptr + dst.to(tl.int64) * ROW + col, values)
    slot = tl.load(entry_slots + row)
    if slot >= 0:
        NG: tl.constexpr = DIM // (2 * HG)
        pair = tl.arange(0, NG)[:, None] * HG + tl.arange(0, HG)[None, :]            # [NG, HG]
        xe = _pool_channels(rows_ptr, stride, ape_ptr, pos_ptr, state_ptr, row_slots, seq, j, 2 * pair, S1, Q, RATIO,
                            SPAN, ROW, WIDTH, DIM, OVERLAP, HAS_APE)
        xo = _pool_channels(rows_ptr, stride, ape_ptr, pos_ptr, state_ptr, row_slots, seq, j, 2 * pair + 1, S1, Q,
                            RATIO, SPAN, ROW, WIDTH, DIM, OVERLAP, HAS_APE)
        xe = _round(xe, BF16)
        xo = _round(xo, BF16)
        inv = tl.math.rsqrt((tl.sum(tl.sum(xe * xe, axis=1), axis=0) + tl.sum(tl.sum(xo * xo, axis=1), axis=0))
                            / DIM + eps)
        xe = _round(tl.load(norm_ptr + 2 * pair).to(tl.float32) * (xe * inv), BF16)
        xo = _round(tl.load(norm_ptr + 2 * pair + 1).to(tl.float32) * (xo * inv), BF16)
        r = pair - (DIM - ROPE) // 2                              # rope pair index (< 0: not rotated)
        is_rope = r >= 0
        c = tl.load(cos_ptr + row.to(tl.int64) * (ROPE // 2) + r, mask=is_rope, other=1.0)
        s = tl.load(sin_ptr + row.to(tl.int64) * (ROPE // 2) + r, mask=is_rope, other=0.0)
        ye = tl.where(is_rope, _round(xe * c - xo * s, BF16), xe)
        yo = tl.where(is_rope, _round(xo * c + xe * s, BF16), xo)
        kv_codec.store_record(entry_pool, slot, ye, yo, DIM, HG, FMT, R, REC, DATA, SCALES, NOPE, NSCALES)


def compressor_step(rows: torch.Tensor, state_pool: torch.Tensor, row_slots: torch.Tensor,
                    entry_pool: torch.Tensor, entry_fmt: str, entry_slots: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, cos: torch.Tensor, sin: torch.Tensor, ratio: int, overlap: bool,
                    dtype: torch.dtype = torch.float32, ape: torch.Tensor | None = None,
                    positions: torch.Tensor | None = None) -> None:
    """Write this step's rows into ``state_pool`` and the entries they complete into ``entry_pool``.

    ``dtype`` is the model's compute dtype: the pooled vector, the normed vector and the rotated
    vector are rounded to it as the engine's torch maths does (rms_norm / apply_rope outputs).
    With ``ape`` [m, width] fp32 and ``positions`` [B, q], ``rows`` are the raw projections
    [C | Z] (any float dtype, any row stride: a column slice of a packed GEMM output) and the
    kernel forms [C | Z + ape[p % m]] in fp32 itself (Compressor.project).
    """
    _check(rows, state_pool, row_slots, entry_slots, norm_weight, cos, sin, ratio, overlap, dtype, ape, positions)
    b, t, two_w = rows.shape
    width, dim, span = _geometry(rows, ratio, overlap)
    kv_codec.check_dim(dim)
    if two_w & (two_w - 1):
        raise ValueError(f"rows width must be a power of two, got {two_w}")
    a = kv_codec.pool_args(entry_pool, entry_fmt, dim)
    if b * t == 0:
        return
    if rows.stride(0) != t * rows.stride(1):
        rows = rows.contiguous()
    has_ape = ape is not None
    _compressor_step_kernel[(b * t,)](
        rows, rows.stride(1), ape.float().contiguous() if has_ape else rows,
        positions.to(torch.int32).contiguous() if has_ape else row_slots, state_pool,
        row_slots.to(torch.int32).contiguous(), entry_pool,
        entry_slots.to(torch.int32).contiguous(), norm_weight.float().contiguous(), cos.float().contiguous(),
        sin.float().contiguous(), t, span - 1, ratio, span, eps, HAS_APE=has_ape, ROW=two_w, WIDTH=width, DIM=dim,
        ROPE=2 * cos.shape[-1], OVERLAP=overlap, BF16=_FLOAT_DTYPES[dtype], HG=kv_codec.pair_group(a, dim),
        NSCALES=a.num_scales, **kv_codec.pool_constexprs(a))


# ---- reference -------------------------------------------------------------------------------


