"""Lightning-indexer top-k for decode: scores against paged index keys, then an exact top-k.

score(t, e) = Σ_h w[t, h] · ReLU(q[t, h] · k_e) / √dI over the entries a query may see: entry
e of sequence b is visible to a query at position p when e < min(n_b, (p + 1) // m), n_b the
sequence's real entry count. The top-k visible entries per query are returned in descending
score order, exact ties going to the LOWER entry index (the engine's stable sort), -1 past the
visible count. A NaN score ranks as -inf (below every number, above nothing visible); -0 equals
+0 (so ReLU zeros of either sign tie).

Two launches (the score pass parallel over entry blocks, the selection serial per row):
1. ``_scores_kernel`` grid (B, ⌈E_max / BLOCK_E⌉): keys read straight from the pool (fp4_index
   dequantized in registers, or raw) through the block table once per sequence and scored for
   each of its q query rows (a verify step's rows see nearly the same entries), scores fp32 ->
   scratch [B·q, E_max]; blocks past every row's visible count return at once.
2. ``_topk_kernel`` grid (B·q,): a running top-KP (KP = next power of two >= k) merged chunk by
   chunk with tl.topk (bitonic) on 64-bit keys (orderable score bits << 31 | (2^31 - 1 - e)), which
   are unique, so the selection is exact and deterministic however chunks fall.
Cost per sequence whose widest row sees n entries: reads n·record_bytes (pass 1); per query row
+ 4n (pass 2), writes 4n;
Hi·dI·n MACs. Pass 2 is serial in n within one program: per CHUNK (default 1024) entries, a
bitonic top-KP of the chunk and a top-KP merge of 2·KP keys, each ~(N/2)·log2(N)·(log2(N)+1)/2
compare-swaps on N keys (N = 1024, k = 512: ~28k per network, ~56k per chunk, so ~0.45M for
n = 8192). Not timed on a GPU yet; very long contexts want the chunks split across programs
(per-chunk top-k written out, then one merge).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import kv_codec
from kernels.decode_reference import check_indexer_topk as _check
from kernels.decode_reference import indexer_topk_reference  # noqa: F401 (re-exported)


@triton.jit
def _visible_count(len_ptr, pos_ptr, row, Q, RATIO):
    """min(n_b, (p + 1) // m) for flat query row b·q + t."""
    n = tl.load(len_ptr + row // Q)
    p = tl.load(pos_ptr + row)
    return tl.minimum(n, tl.maximum(p + 1, 0) // RATIO)


@triton.jit
def _scores_kernel(q_ptr, w_ptr, w_stride, w_scale, pool, table_ptr, len_ptr, pos_ptr, scores_ptr, Q, HI, F, E_MAX,
                   RATIO, scale,
                   DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
                   Q_PAD: tl.constexpr,
                   FMT: tl.constexpr, R: tl.constexpr, REC: tl.constexpr, DATA: tl.constexpr,
                   SCALES: tl.constexpr, NOPE: tl.constexpr, GROUP: tl.constexpr):
    """One sequence's entry block, scored for each of its q ≤ Q_PAD query rows (an unrolled loop,
    so the key tile stays in registers): the keys are read once."""
    seq = tl.program_id(0)
    e0 = tl.program_id(1) * BLOCK_E
    widest = _visible_count(len_ptr, pos_ptr, seq * Q, Q, RATIO)
    for t in tl.static_range(1, Q_PAD):                                          # the rows' largest count
        if t < Q:
            widest = tl.maximum(widest, _visible_count(len_ptr, pos_ptr, seq * Q + t, Q, RATIO))
    if e0 < widest:
        e = e0 + tl.arange(0, BLOCK_E)
        block = tl.load(table_ptr + seq.to(tl.int64) * F + e // R, mask=e < widest, other=0)
        slots = block.to(tl.int64) * R + e % R
        keys = kv_codec.load_keys(pool, slots, e < widest, DI, FMT, R, REC, DATA, SCALES, NOPE, GROUP)  # [BE, dI]
        h = tl.arange(0, BLOCK_HI)
        for t in tl.static_range(Q_PAD):
            if t < Q:
                row = seq * Q + t
                valid = e < _visible_count(len_ptr, pos_ptr, row, Q, RATIO)
                q = tl.load(q_ptr + (row.to(tl.int64) * HI + h)[:, None] * DI + tl.arange(0, DI)[None, :],
                            mask=(h < HI)[:, None], other=0.0).to(tl.float32)          # [BHI, dI]
                w = tl.load(w_ptr + row.to(tl.int64) * w_stride + h, mask=h < HI, other=0.0).to(tl.float32) * w_scale
                dots = tl.dot(q, tl.trans(keys), input_precision=PRECISION)             # [BHI, BE]
                s = tl.where(dots != dots, dots, tl.maximum(dots, 0.0)) * scale      # ReLU keeping NaN
                score = tl.sum(s * w[:, None], axis=0)                                  # [BE]
                tl.store(scores_ptr + row.to(tl.int64) * E_MAX + e, score, mask=valid)


@triton.jit
def _order_keys(score, e, valid):
    """Unique int64 keys, larger = ranked first; -1 for entries not visible."""
    score = tl.where(score != score, float("-inf"), score)
    score = tl.where(score == 0.0, 0.0, score)                  # -0 -> +0
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, ~bits, bits | -2147483648)     # float order as unsigned order
    key = ((ordered.to(tl.int64) & 0xFFFFFFFF) << 31) | (2147483647 - e).to(tl.int64)
    return tl.where(valid, key, -1)


@triton.jit
def _topk_kernel(scores_ptr, len_ptr, pos_ptr, table_ptr, idx_ptr, slot_ptr, Q, F, E_MAX, RATIO, K,
                 KP: tl.constexpr, CHUNK: tl.constexpr, R: tl.constexpr):
    row = tl.program_id(0)
    limit = _visible_count(len_ptr, pos_ptr, row, Q, RATIO)
    best = tl.full([KP], -1, tl.int64)
    c = tl.arange(0, CHUNK)
    for start in range(0, limit, CHUNK):
        e = start + c
        valid = e < limit
        score = tl.load(scores_ptr + row.to(tl.int64) * E_MAX + e, mask=valid, other=0.0)
        keys = _order_keys(score, e, valid)
        if CHUNK > KP:
            keys = tl.topk(keys, KP)
        best = tl.topk(tl.reshape(tl.join(best, keys), [2 * KP]), KP)
    e = tl.where(best >= 0, 2147483647 - (best & 2147483647), -1).to(tl.int32)     # [KP], best first
    block = tl.load(table_ptr + (row // Q).to(tl.int64) * F + tl.maximum(e, 0) // R, mask=e >= 0, other=0)
    slot = tl.where(e >= 0, block * R + tl.maximum(e, 0) % R, -1)
    j = tl.arange(0, KP)
    tl.store(idx_ptr + row.to(tl.int64) * K + j, e, mask=j < K)
    tl.store(slot_ptr + row.to(tl.int64) * K + j, slot.to(tl.int32), mask=j < K)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt: str, block_table: torch.Tensor,
                 lengths: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int,
                 max_entries: int | None = None, precision: str = "ieee", chunk: int = 1024,
                 weight_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k entries per decode query -> (entry indices, slots), int32 [B, q, topk], -1 padded.

    q [B, q, Hi, dI] (rope applied), weights [B, q, Hi] (w·Hi^-0.5, as Indexer.queries), pool the
    index-key pool [blocks, R, record] of ``fmt`` (fp4_index or raw), block_table [B, F] full-pool
    block ids (entry e lives in block table[b, e // R] at offset e % R), lengths [B] entries written,
    positions [B, q]. max_entries (default F·R) bounds the entry axis (the scratch width).
    ``weight_scale`` multiplies the weights in fp32 (Indexer.queries' Hi^-0.5), which may be a
    column slice of a wider projection output (unit stride along Hi).
    """
    _check(q, weights, block_table, lengths, positions, ratio, topk)
    b, t, hi, di = q.shape
    if weights.stride(0) != t * weights.stride(1):
        weights = weights.contiguous()
    kv_codec.check_dim(di)
    a = kv_codec.pool_args(pool, fmt, di)
    e_max = block_table.shape[1] * a.records_per_block if max_entries is None else max_entries
    rows = b * t
    dev = q.device
    table = block_table.to(torch.int32).contiguous()
    lens = lengths.to(torch.int32).contiguous()
    pos = positions.to(torch.int32).contiguous()
    scores = torch.empty(rows, max(e_max, 1), dtype=torch.float32, device=dev)
    block_e = 16
    block_hi = max(16, triton.next_power_of_2(hi))
    _scores_kernel[(b, triton.cdiv(max(e_max, 1), block_e))](
        q.contiguous(), weights, weights.stride(1), float(weight_scale), pool, table, lens, pos, scores, t, hi,
        table.shape[1], e_max, ratio,
        di**-0.5, DI=di, BLOCK_HI=block_hi, BLOCK_E=block_e, PRECISION=precision,
        Q_PAD=triton.next_power_of_2(max(t, 1)), **kv_codec.pool_constexprs(a))
    idx = torch.empty(b, t, topk, dtype=torch.int32, device=dev)
    slots = torch.empty_like(idx)
    kp = triton.next_power_of_2(topk)
    chunk = max(kp, min(triton.next_power_of_2(chunk), triton.next_power_of_2(max(e_max, 1))))
    _topk_kernel[(rows,)](scores, lens, pos, table, idx, slots, t, table.shape[1], e_max, ratio, topk,
                          KP=kp, CHUNK=chunk, R=a.records_per_block)
    return idx, slots


