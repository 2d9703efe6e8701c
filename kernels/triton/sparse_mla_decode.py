"""Decode attention over paged KV: window keys + indexer-picked entries + a per-head sink, fused.

DeepSeek-V4 attends each query token to (a) its sliding window, (b) the compressed entries the
indexer chose (CSA) or every visible entry (HCA), and optionally (c) this step's own keys that
are not in a pool yet (causal within the step). K = V: one latent vector per key. A sink logit
s_h joins the softmax denominator only: p = e^l / (Σ e^l + e^{s_h}), l = q·k / √D.

The kernel reads records straight from the pools by slot and dequantizes them in registers
(``kv_codec.load_keys``); no gathered or dequantized copy is ever written. One program owns
one query token and BLOCK_H heads, streaming key blocks of BLOCK_N through an online softmax
seeded with the sink (m = s_h, l = 1), so a row with every key masked returns exactly 0.

Layouts: q [B, q, H, D] (any float dtype); sink [H]; window/entry pools [blocks, R, record]
(``kv_codec`` formats); window_slots [B, q, W], entry_slots [B, q, K] int32/int64, -1 masked;
new_kv [B, q, D] (query j sees new keys 0..j). Output fp32 [B, q, H, D].
Cost per query token: (W + K + q) · record_bytes read once per head block (⌈H / BLOCK_H⌉ times,
L2-resident after the first), 4·(W + K + q)·H·D FLOPs.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.triton import kv_codec


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
def _attend_block(q, k, valid, m_i, l_i, acc, scale, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """One online-softmax step over keys k [N, D] (valid [N]) for q [BH, D]."""
    s = _dot(q, tl.trans(k), PRECISION, EMULATE) * scale                 # [BH, N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p, k, PRECISION, EMULATE)
    return m_new, l_i, acc


@triton.jit
def _sparse_mla_decode_kernel(
        q_ptr, sink_ptr, out_ptr, win_pool, win_slots, W, ent_pool, ent_slots, K, new_ptr, Q, H, scale,
        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_NEW: tl.constexpr,
        PRECISION: tl.constexpr, EMULATE: tl.constexpr,
        W_FMT: tl.constexpr, W_R: tl.constexpr, W_REC: tl.constexpr, W_DATA: tl.constexpr,
        W_SCALES: tl.constexpr, W_NOPE: tl.constexpr, W_GROUP: tl.constexpr,
        E_FMT: tl.constexpr, E_R: tl.constexpr, E_REC: tl.constexpr, E_DATA: tl.constexpr,
        E_SCALES: tl.constexpr, E_NOPE: tl.constexpr, E_GROUP: tl.constexpr):
    row = tl.program_id(0)                                                   # b·q + t
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    cols = tl.arange(0, D)
    q_off = (row.to(tl.int64) * H + heads)[:, None] * D + cols[None, :]
    q = tl.load(q_ptr + q_off, mask=hmask[:, None], other=0.0).to(tl.float32)  # [BH, D]
    m_i = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)      # the sink seeds the max ...
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)                                  # ... and adds e^0 = 1
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(0, W, BLOCK_N):
        idx = start + n
        slots = tl.load(win_slots + row.to(tl.int64) * W + idx, mask=idx < W, other=-1)
        valid = slots >= 0
        k = kv_codec.load_keys(win_pool, slots, valid, D, W_FMT, W_R, W_REC, W_DATA, W_SCALES, W_NOPE, W_GROUP)
        m_i, l_i, acc = _attend_block(q, k, valid, m_i, l_i, acc, scale, PRECISION, EMULATE)
    for start in range(0, K, BLOCK_N):
        idx = start + n
        slots = tl.load(ent_slots + row.to(tl.int64) * K + idx, mask=idx < K, other=-1)
        valid = slots >= 0
        k = kv_codec.load_keys(ent_pool, slots, valid, D, E_FMT, E_R, E_REC, E_DATA, E_SCALES, E_NOPE, E_GROUP)
        m_i, l_i, acc = _attend_block(q, k, valid, m_i, l_i, acc, scale, PRECISION, EMULATE)
    if HAS_NEW:
        first = (row // Q) * Q                                               # row of token 0 of this sequence
        t = row - first
        for start in range(0, Q, BLOCK_N):
            j = start + n
            valid = j <= t                                                  # causal within the step
            k = tl.load(new_ptr + (first + j).to(tl.int64)[:, None] * D + cols[None, :], mask=valid[:, None],
                        other=0.0).to(tl.float32)
            m_i, l_i, acc = _attend_block(q, k, valid, m_i, l_i, acc, scale, PRECISION, EMULATE)
    tl.store(out_ptr + q_off, acc / l_i[:, None], mask=hmask[:, None])


def _check(q: torch.Tensor, sink: torch.Tensor, window_slots: torch.Tensor, entry_slots: torch.Tensor | None,
           new_kv: torch.Tensor | None) -> None:
    b, t, h, _ = q.shape
    if sink.shape != (h,):
        raise ValueError(f"sink must be [{h}], got {tuple(sink.shape)}")
    for name, slots in (("window_slots", window_slots), ("entry_slots", entry_slots)):
        if slots is not None and (slots.dim() != 3 or slots.shape[:2] != (b, t) or slots.dtype.is_floating_point):
            raise ValueError(f"{name} must be int [{b}, {t}, N], got {slots.dtype} {tuple(slots.shape)}")
    if new_kv is not None and new_kv.shape != (b, t, q.shape[-1]):
        raise ValueError(f"new_kv must be [{b}, {t}, {q.shape[-1]}], got {tuple(new_kv.shape)}")


def sparse_mla_decode(q: torch.Tensor, sink: torch.Tensor, window_pool: torch.Tensor, window_fmt: str,
                      window_slots: torch.Tensor, entry_pool: torch.Tensor | None = None, entry_fmt: str = "fp32",
                      entry_slots: torch.Tensor | None = None, new_kv: torch.Tensor | None = None,
                      scale: float | None = None, precision: str = "ieee", block_n: int = 16) -> torch.Tensor:
    """Sink attention of q [B, q, H, D] over window + entry records (+ new_kv) -> fp32 [B, q, H, D].

    ``precision``: tl.dot's input_precision "ieee" (fp32 products; register-hungry FMA dots on a
    GPU), "tf32x3" (~fp32 accuracy on tensor cores), "tf32" (~1e-3 relative), or "bf16" (bf16
    operands, see _dot; the only mode without register spills at D = 512). ``entry_pool`` None
    (or K = 0) attends the window only.
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
    block_h = 16
    grid = (b * t, triton.cdiv(h, block_h))
    new = new_kv.contiguous() if new_kv is not None else q
    _sparse_mla_decode_kernel[grid](
        q.contiguous(), sink.float().contiguous(), out, window_pool, window_slots.contiguous(), window_slots.shape[-1],
        entry_pool, entry_slots.contiguous(), entry_slots.shape[-1], new, t, h,
        d**-0.5 if scale is None else scale, D=d, BLOCK_H=block_h, BLOCK_N=block_n, HAS_NEW=new_kv is not None,
        PRECISION=precision, EMULATE=os.environ.get("TRITON_INTERPRET") == "1",
        **kv_codec.pool_constexprs(wa, "W_"), **kv_codec.pool_constexprs(ea, "E_"),
        num_warps=8 if d >= 256 else 4)  # q, acc and a key tile are each BLOCK_H·D or BLOCK_N·D fp32
    return out


# ---- reference -------------------------------------------------------------------------------

def read_records(pool: torch.Tensor, fmt: str, slots: torch.Tensor, dim: int) -> torch.Tensor:
    """Gather + dequantize slots [...] (-1 -> zero row) -> fp32 [..., dim] via kernels.reference."""
    flat = slots.reshape(-1).long()
    if fmt in kv_codec.RAW_DTYPES:
        rows = pool.reshape(-1, dim)[flat.clamp(min=0)].float()
        rows = torch.where((flat >= 0)[:, None], rows, 0.0)
    else:
        rows = reference.gather_dequantize(pool, flat, fmt, torch.float32, dim)
    return rows.view(*slots.shape, dim)


def sparse_mla_decode_reference(q: torch.Tensor, sink: torch.Tensor, window_pool: torch.Tensor, window_fmt: str,
                                window_slots: torch.Tensor, entry_pool: torch.Tensor | None = None,
                                entry_fmt: str = "fp32", entry_slots: torch.Tensor | None = None,
                                new_kv: torch.Tensor | None = None, scale: float | None = None,
                                precision: str = "ieee", block_n: int = 16) -> torch.Tensor:
    """Plain gather, dequantize and softmax over [window | entries | new | sink]."""
    _check(q, sink, window_slots, entry_slots, new_kv)
    b, t, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qf = q.float()
    keys = [read_records(window_pool, window_fmt, window_slots, d)]                 # [B, q, W, D]
    valid = [window_slots >= 0]
    if entry_pool is not None and entry_slots is not None:
        keys.append(read_records(entry_pool, entry_fmt, entry_slots, d))            # [B, q, K, D]
        valid.append(entry_slots >= 0)
    if new_kv is not None:
        keys.append(new_kv.float()[:, None].expand(b, t, t, d))                     # [B, q, q, D]
        valid.append(torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t))
    keys, valid = torch.cat(keys, dim=2), torch.cat(valid, dim=2)                  # [B, q, L, D], [B, q, L]
    logits = torch.einsum("bqhd,bqld->bqhl", qf, keys) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    sinks = sink.float().view(1, 1, h, 1).expand(b, t, h, 1)
    probs = torch.softmax(torch.cat((logits, sinks), dim=-1), dim=-1)[..., :-1]    # the sink takes no value
    return torch.einsum("bqhl,bqld->bqhd", probs, keys)

