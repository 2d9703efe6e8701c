"""Decode attention over paged KV: window keys + indexer-picked entries + a per-head sink, fused.

DeepSeek-V4 attends each query token to (a) its sliding window, (b) the compressed entries the
indexer chose (CSA) or every visible entry (HCA), and optionally (c) this step's own keys that
are not in a pool yet (causal within the step). K = V: one latent vector per key. A sink logit
s_h joins the softmax denominator only: p = e^l / (Σ e^l + e^{s_h}), l = q·k / √D.

The kernel reads records straight from the pools by slot and dequantizes them in registers
(``kv_codec.load_key_cols``); no gathered or dequantized copy is ever written. One program owns
one sequence's q query tokens for BLOCK_H heads and BLOCK_DV of the D output columns: its tile
has M = Q_PAD·BLOCK_H rows (row r is token r // BLOCK_H, head r % BLOCK_H), and it streams key
blocks of BLOCK_N through an online softmax seeded with the sink (m = s_h, l = 1), so a row with
every key masked returns exactly 0. Per key block the scores q·kᵀ are summed over D in chunks of
BLOCK_D (q and keys re-read per chunk, from L1/L2: a chunk is all that is live), then the block's
BLOCK_DV value columns are read once more for p·v. Holding q, a whole [BLOCK_N, D] key tile and
the accumulator at once cost 255 registers and 13-60 KB of spills per thread at the released
shapes (D = 512, fp32 dots); chunked, no launch of the engine spills on sm_90a or sm_100a
(`perf/triton_compile_report.py`). A tile of 32 rows splits D into two column parts, each its own
program computing the same scores (the price of an accumulator of M·BLOCK_DV fp32); the parts run
side by side and share the key blocks in L2.

A verify step's q tokens read nearly the same records, so a table can be *shared*: every column
holds one slot for all of a sequence's rows, or −1 where a row does not see it (the window:
positions start−W+1 .. start−1, a later token seeing a suffix; HCA's visible entries). A shared
table's block is loaded once for the q rows (the union slot of a column is its largest entry) and
masked per row. A per-row table (CSA's top-k picks) is read row by row, the other rows masked.
Either way a row meets its own keys in its table's column order with masked keys as exact no-ops
(α = 1, p = 0), so per-row and shared reads of the same keys give the same bits.

Layouts: q [B, q, H, D] (any float dtype); sink [H]; window/entry pools [blocks, R, record]
(``kv_codec`` formats); window_slots [B, q, W], entry_slots [B, q, K] int32/int64, -1 masked;
new_kv [B, q, D] (query j sees new keys 0..j; shared by nature). Output fp32 [B, q, H, D].
Records read per sequence and head block: W + K + q with shared tables, q·(W + K) + q per row
(the head blocks and column parts after the first find them in L2); FLOPs 2·M·(D + BLOCK_DV) per
key a program streams.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.triton import kv_codec
from kernels.decode_reference import check_sparse_mla_decode as _check
from kernels.decode_reference import read_records, sparse_mla_decode_reference  # noqa: F401 (re-exported)

# M = tokens × heads of one program; a verify step folds its tokens into M.
ROWS_PER_PROGRAM = 32
SCORE_CHUNK = 32            # D columns of q and of the keys live at once while scoring (the K of an FMA dot)
ACC_ELEMENTS = 16 * 512     # M·BLOCK_DV: the accumulator, 32 fp32 registers per thread at 8 warps
NUM_WARPS = 8
# Let ptxas use every register 8 warps may hold: left to itself it caps some M = 32 tiles at 128
# registers (two programs per SM) and spills 8-60 B, where ~200 registers need none.
MAX_REGISTERS = 255


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """a @ b with fp32 accumulation. PRECISION "bf16" feeds the tensor cores bf16 operands: exact
    for bf16 queries and quantized keys (e4m3, e2m1·e4m3 and bf16 values all fit bf16), lossy only
    in the probabilities. The interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton
    #11584), so under it (EMULATE) the operands are rounded to bf16 values but stay fp32: the same
    products and accumulation."""
    if PRECISION == "bf16":
        if EMULATE:
            out = tl.dot(kv_codec.round_bf16(a), kv_codec.round_bf16(b), input_precision="ieee")
        else:
            out = tl.dot(kv_codec.cast(a, tl.bfloat16), kv_codec.cast(b, tl.bfloat16))
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _scores(q_ptr, q_rows, live, pool, slots, keys_ok, D: tl.constexpr, BLOCK_D: tl.constexpr,
            PRECISION: tl.constexpr, EMULATE: tl.constexpr, FMT: tl.constexpr, R: tl.constexpr,
            REC: tl.constexpr, DATA: tl.constexpr, SCALES: tl.constexpr, NOPE: tl.constexpr, GROUP: tl.constexpr):
    """q · kᵀ [M, N] for the keys of ``slots`` [N], summed over D in BLOCK_D-wide chunks (q is
    re-read per chunk: only a chunk of q and of the keys is ever live), and which keys are finite
    [N] (a non-finite element enters the dot as 0; its key marks the rows that see it)."""
    s = tl.zeros([q_rows.shape[0], slots.shape[0]], tl.float32)
    finite = keys_ok | ~keys_ok
    for c0 in range(0, D, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        k = kv_codec.load_key_cols(pool, slots, keys_ok, c0, BLOCK_D, D, FMT, R, REC, DATA, SCALES, NOPE, GROUP)
        ok = tl.abs(k) < float("inf")                                     # False for ±Inf and NaN
        finite = finite & (tl.min(ok.to(tl.int32), axis=1) == 1)
        s += _dot(q, tl.trans(tl.where(ok, k, 0.0)), PRECISION, EMULATE)
    return s, finite


@triton.jit
def _attend_block(q_ptr, q_rows, live, pool, slots, keys_ok, valid, m_i, l_i, acc, bad, scale, d0,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
                  EMULATE: tl.constexpr, FMT: tl.constexpr, R: tl.constexpr, REC: tl.constexpr,
                  DATA: tl.constexpr, SCALES: tl.constexpr, NOPE: tl.constexpr, GROUP: tl.constexpr):
    """One online-softmax step over the keys of ``slots`` [N] (``keys_ok`` [N]: which to read)
    for this program's output columns d0 .. d0 + BLOCK_DV; valid [M, N] per row and key.

    The rows of a tile see different keys of one block, and a masked row's p = 0 times a NaN key
    would still be NaN: a non-finite key enters the dots as 0 and marks only the rows that see
    it `bad` (they end NaN, as reading it makes any row)."""
    s, finite = _scores(q_ptr, q_rows, live, pool, slots, keys_ok, D, BLOCK_D, PRECISION, EMULATE,
                        FMT, R, REC, DATA, SCALES, NOPE, GROUP)
    bad = bad | (tl.sum((valid & ~finite[None, :]).to(tl.int32), axis=1) > 0)
    s = tl.where(valid, s * scale, float("-inf"))                         # [M, N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = kv_codec.load_key_cols(pool, slots, keys_ok, d0, BLOCK_DV, D, FMT, R, REC, DATA, SCALES, NOPE, GROUP)
    v = tl.where(tl.abs(v) < float("inf"), v, 0.0)                        # [N, DV]
    acc = acc * alpha[:, None] + _dot(p, v, PRECISION, EMULATE)
    return m_new, l_i, acc, bad


@triton.jit
def _per_row(rv, Q_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """[Q_PAD, N] per token → [M, N] per tile row (every head of a token alike)."""
    return tl.reshape(tl.broadcast_to(rv[:, None, :], (Q_PAD, BLOCK_H, BLOCK_N)), (Q_PAD * BLOCK_H, BLOCK_N))


@triton.jit
def _attend_table(q_ptr, q_rows, live, token, m_i, l_i, acc, bad, scale, d0, pool, slots_ptr, seq, Q, N_COLS,
                  SHARED: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  Q_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                  EMULATE: tl.constexpr, FMT: tl.constexpr, R: tl.constexpr, REC: tl.constexpr,
                  DATA: tl.constexpr, SCALES: tl.constexpr, NOPE: tl.constexpr, GROUP: tl.constexpr):
    """Stream one slot table [B, Q, N_COLS] of sequence `seq` into the softmax state."""
    n = tl.arange(0, BLOCK_N)
    t = tl.arange(0, Q_PAD)
    rows = (seq * Q + t).to(tl.int64)                                       # [Q_PAD] table rows
    if SHARED:
        for start in range(0, N_COLS, BLOCK_N):
            idx = start + n
            tile = tl.load(slots_ptr + rows[:, None] * N_COLS + idx[None, :],
                           mask=(t[:, None] < Q) & (idx[None, :] < N_COLS), other=-1)  # [Q_PAD, N]
            union = tl.max(tile, axis=0)                                    # a column's one slot, or −1
            valid = _per_row(tile >= 0, Q_PAD, BLOCK_H, BLOCK_N)
            m_i, l_i, acc, bad = _attend_block(q_ptr, q_rows, live, pool, union, union >= 0, valid, m_i, l_i, acc,
                                               bad, scale, d0, D, BLOCK_D, BLOCK_DV, PRECISION, EMULATE,
                                               FMT, R, REC, DATA, SCALES, NOPE, GROUP)
    else:
        for j in tl.static_range(Q_PAD):
            if j < Q:
                for start in range(0, N_COLS, BLOCK_N):
                    idx = start + n
                    slots = tl.load(slots_ptr + (seq * Q + j).to(tl.int64) * N_COLS + idx, mask=idx < N_COLS,
                                    other=-1)
                    valid = (token == j)[:, None] & (slots >= 0)[None, :]
                    m_i, l_i, acc, bad = _attend_block(q_ptr, q_rows, live, pool, slots, slots >= 0, valid, m_i, l_i,
                                                       acc, bad, scale, d0, D, BLOCK_D, BLOCK_DV, PRECISION,
                                                       EMULATE, FMT, R, REC, DATA, SCALES, NOPE, GROUP)
    return m_i, l_i, acc, bad


@triton.jit
def _sparse_mla_decode_kernel(
        q_ptr, sink_ptr, out_ptr, win_pool, win_slots, W, ent_pool, ent_slots, K, new_ptr, Q, H, scale,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, Q_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_NEW: tl.constexpr, W_SHARED: tl.constexpr, E_SHARED: tl.constexpr,
        PRECISION: tl.constexpr, EMULATE: tl.constexpr,
        W_FMT: tl.constexpr, W_R: tl.constexpr, W_REC: tl.constexpr, W_DATA: tl.constexpr,
        W_SCALES: tl.constexpr, W_NOPE: tl.constexpr, W_GROUP: tl.constexpr,
        E_FMT: tl.constexpr, E_R: tl.constexpr, E_REC: tl.constexpr, E_DATA: tl.constexpr,
        E_SCALES: tl.constexpr, E_NOPE: tl.constexpr, E_GROUP: tl.constexpr):
    seq = tl.program_id(0)
    d0 = tl.program_id(2) * BLOCK_DV                                         # this program's output columns
    r = tl.arange(0, Q_PAD * BLOCK_H)                                        # tile rows
    token = r // BLOCK_H
    heads = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    live = (token < Q) & (heads < H)
    q_rows = ((seq * Q + token).to(tl.int64) * H + heads) * D                # [M] row offsets of q and out
    m_i = tl.load(sink_ptr + heads, mask=heads < H, other=0.0).to(tl.float32)  # the sink seeds the max ...
    l_i = tl.full([Q_PAD * BLOCK_H], 1.0, tl.float32)                          # ... and adds e^0 = 1
    acc = tl.zeros([Q_PAD * BLOCK_H, BLOCK_DV], tl.float32)
    bad = r < 0                                                              # rows that read a non-finite key
    m_i, l_i, acc, bad = _attend_table(q_ptr, q_rows, live, token, m_i, l_i, acc, bad, scale, d0, win_pool,
                                       win_slots, seq, Q, W, W_SHARED, D, BLOCK_D, BLOCK_DV, Q_PAD, BLOCK_H, BLOCK_N,
                                       PRECISION, EMULATE, W_FMT, W_R, W_REC, W_DATA, W_SCALES, W_NOPE, W_GROUP)
    m_i, l_i, acc, bad = _attend_table(q_ptr, q_rows, live, token, m_i, l_i, acc, bad, scale, d0, ent_pool,
                                       ent_slots, seq, Q, K, E_SHARED, D, BLOCK_D, BLOCK_DV, Q_PAD, BLOCK_H, BLOCK_N,
                                       PRECISION, EMULATE, E_FMT, E_R, E_REC, E_DATA, E_SCALES, E_NOPE, E_GROUP)
    if HAS_NEW:  # this step's keys: a raw [B·q, D] pool, key j at row seq·q + j
        n = tl.arange(0, BLOCK_N)
        for start in range(0, Q, BLOCK_N):
            j = start + n
            valid = (j[None, :] <= token[:, None]) & (j < Q)[None, :]        # causal within the step
            m_i, l_i, acc, bad = _attend_block(q_ptr, q_rows, live, new_ptr, seq * Q + j, j < Q, valid, m_i, l_i,
                                               acc, bad, scale, d0, D, BLOCK_D, BLOCK_DV, PRECISION, EMULATE,
                                               0, 1, D, 0, 0, 0, 1)
    cols = d0 + tl.arange(0, BLOCK_DV)
    tl.store(out_ptr + q_rows[:, None] + cols[None, :], tl.where(bad[:, None], float("nan"), acc / l_i[:, None]),
             mask=live[:, None])


def value_block(d: int, rows: int) -> int:
    """Output columns per program for an M = ``rows`` tile: all of D while M·D fits ACC_ELEMENTS
    (decode at D = 512: no score is computed twice), else D in equal power-of-two parts."""
    return max(16, min(d, ACC_ELEMENTS // rows))


def program_shape(tokens: int) -> tuple[int, int]:
    """(Q_PAD, BLOCK_H) for q tokens per sequence: M = Q_PAD·BLOCK_H ≤ ROWS_PER_PROGRAM rows (more
    for q > 32), at least 16 (tl.dot's smallest M), at most 16 heads. A shared table is read once
    per (sequence, head block): ⌈H / BLOCK_H⌉ times, against q·⌈H / 16⌉ for per-token programs."""
    q_pad = triton.next_power_of_2(max(tokens, 1))
    return q_pad, max(1, min(16, ROWS_PER_PROGRAM // q_pad))


def sparse_mla_decode(q: torch.Tensor, sink: torch.Tensor, window_pool: torch.Tensor, window_fmt: str,
                      window_slots: torch.Tensor, entry_pool: torch.Tensor | None = None, entry_fmt: str = "fp32",
                      entry_slots: torch.Tensor | None = None, new_kv: torch.Tensor | None = None,
                      scale: float | None = None, precision: str = "ieee", block_n: int = 16,
                      window_shared: bool = False, entries_shared: bool = False,
                      block_d: int | None = None, block_dv: int | None = None) -> torch.Tensor:
    """Sink attention of q [B, q, H, D] over window + entry records (+ new_kv) -> fp32 [B, q, H, D].

    ``precision``: tl.dot's input_precision "ieee" (fp32 products; register-hungry FMA dots on a
    GPU), "tf32x3" (~fp32 accuracy on tensor cores), "tf32" (~1e-3 relative), or "bf16" (bf16
    operands, see _dot). ``entry_pool`` None
    (or K = 0) attends the window only. ``window_shared`` / ``entries_shared``: the table is
    shared across each sequence's rows (module docstring) and read once per sequence; a table
    that is not shared gives wrong results under the flag, so only the step's own builders
    (engine/v4/step_meta.py) set it. ``block_d`` / ``block_dv``: the score chunk and the output
    columns per program (powers of two dividing D; default SCORE_CHUNK, all of D under the
    interpreter, and `value_block`).
    """
    _check(q, sink, window_slots, entry_slots, new_kv)
    b, t, h, d = q.shape
    kv_codec.check_dim(d)
    wa = kv_codec.pool_args(window_pool, window_fmt, d)
    if entry_pool is None or entry_slots is None or entry_slots.shape[-1] == 0:
        entry_pool, ea, entry_slots = window_pool, wa, window_slots[..., :0]
    else:
        ea = kv_codec.pool_args(entry_pool, entry_fmt, d)
    out = torch.empty(b, t, h, d, dtype=torch.float32, device=q.device)
    q_pad, block_h = program_shape(t)
    emulate = os.environ.get("TRITON_INTERPRET") == "1"
    if block_d is None:  # the interpreter pays per op, not per register: one chunk
        block_d = d if emulate else min(SCORE_CHUNK, d)
    block_dv = value_block(d, q_pad * block_h) if block_dv is None else block_dv
    for name, value in (("block_d", block_d), ("block_dv", block_dv)):
        if value < 16 or d % value or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16 dividing D = {d}, got {value}")
    grid = (b, triton.cdiv(h, block_h), d // block_dv)
    new = new_kv.contiguous() if new_kv is not None else q
    _sparse_mla_decode_kernel[grid](
        q.contiguous(), sink.float().contiguous(), out, window_pool, window_slots.contiguous(), window_slots.shape[-1],
        entry_pool, entry_slots.contiguous(), entry_slots.shape[-1], new, t, h,
        d**-0.5 if scale is None else scale, D=d, BLOCK_D=block_d, BLOCK_DV=block_dv, Q_PAD=q_pad,
        BLOCK_H=block_h, BLOCK_N=block_n, HAS_NEW=new_kv is not None, W_SHARED=window_shared,
        E_SHARED=entries_shared, PRECISION=precision, EMULATE=emulate,
        **kv_codec.pool_constexprs(wa, "W_"), **kv_codec.pool_constexprs(ea, "E_"), num_warps=NUM_WARPS,
        maxnreg=MAX_REGISTERS)
    return out


# ---- reference -------------------------------------------------------------------------------


