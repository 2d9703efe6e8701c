"""CPU (numba) lightning-indexer top-k for the decode step: `indexer_topk`, one numba call.

Same signature and semantics as kernels/triton/indexer_topk.py (its docstring defines them):
score(t, e) = Σ_h w[t, h] · ReLU(q[t, h] · k_e) / √dI over the entries e < min(n_b, (p + 1) // m)
a query may see, the top-k in descending score order with exact ties to the lower entry index,
NaN ranking as -inf (still above every invisible entry), -0 == +0, -1 past the visible count.

Why: the torch reference scores every addressable entry of the padded table (gather +
dequantize all of it, an einsum into [B, q, Hi, E], a full stable sort). Here each sequence's
visible entries only are read, a tile of ``_TILE`` keys at a time, decoded from the pool by slot
into an fp32 tile (fp4_index as code value x ue8m0 scale in fp32, the reference's rule, bf16 by a
shift, fp32 copied), scored for every query row of the sequence (a verify step's rows share the keys), and
the selection is a partition + sort of the ``topk`` largest of unique 64-bit keys.

Numerics:
- q · k is a length-dI dot in LLVM's vectorised order with fused multiply-adds
  (``fastmath={"reassoc", "contract"}`` on that loop only; NaN / Inf semantics kept), torch's
  einsum (MKL sgemm) has its own order. Tolerance: |ours - reference| <= 1e-6 · Σ_h |w_h| ·
  (|q_h|·|k|) / √dI (measured ~1e-8 of that at Hi = 64, dI = 128; either is as close to fp64).
  The rest is the reference's op sequence: ReLU (keeping NaN), times 1/√dI in fp32, times
  w = weights · weight_scale (fp32, formed as the reference does), summed over h from h = 0
  (torch's sum may group the heads differently).
- The dot runs in 256-bit vectors (LLVM prefers them on AVX-512 cores and numba offers no
  per-function override), about half of MKL's sgemm rate: it is most of the time at long
  context; decode, the epilogue and the selection are ~25% together.
- Given the scores the selection is exact: key = (orderable score bits << 32) | (2^32 - 1 - e),
  NaN read as -inf and -0 as +0 first, so keys are unique and the k largest, in descending key
  order, are exactly the stable sort's first k. With exactly representable scores (small dyadic
  q / k / w, dI a power of 4) the result equals the reference's bit for bit.

Pool formats fp32, bf16 and fp4_index are read in the kernel; any other format (fp16,
fp8_ds_mla, fp4_kv) falls back to the torch reference (index keys are not stored that way).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from kernels.cpu_dots import dot4x4
from kernels.cpu_numerics import F32, U32, U64, bits_f32, borrow, e2m1_value, f32_bits, ue8m0_value
from kernels.formats import get_format
from kernels.decode_reference import check_indexer_topk as _check
from kernels.decode_reference import indexer_topk_reference

_TILE = 64          # keys decoded and scored at a time: the fp32 tile [64, dI] stays in L1 / L2
_BLOCK = 4          # micro-kernel: 4 heads x 4 entries of dots in registers (kernels/cpu_dots.py)
_KINDS = {"fp32": 0, "bf16": 1, "fp4_index": 2}
_LOW32 = U64(0xFFFFFFFF)
_SIGN = U32(0x80000000)
# e2m1 code -> value (exact); numba freezes the global array into the code. A table lookup
# decodes ~5x faster here than the branch-free bit formula (measured).
_E2M1 = np.array([e2m1_value(U32(c)) for c in range(16)], dtype=np.float32)


# ---- key decode: one pool record -> one fp32 row ------------------------------------------------

@njit(cache=True, error_model="numpy")
def _fp4_index_row(rec, out):
    """e2m1 codes (two per byte, even element low) times one ue8m0 scale per 32 values: code
    value (a 16-entry table of e2m1_value) x scale in fp32, as the reference dequantizes."""
    half = out.shape[0] // 2
    for g in range(out.shape[0] // 32):
        s = ue8m0_value(rec[half + g])
        for j in range(16):
            c = rec[g * 16 + j]
            out[g * 32 + 2 * j] = F32(_E2M1[c & 15] * s)
            out[g * 32 + 2 * j + 1] = F32(_E2M1[c >> 4] * s)


@njit(cache=True, error_model="numpy")
def _bf16_row(rec, out):
    src = rec.view(np.uint16)
    for j in range(out.shape[0]):
        out[j] = bits_f32(U32(U32(src[j]) << U32(16)))


@njit(cache=True, error_model="numpy")
def _fp32_row(rec, out):
    src = rec.view(np.float32)
    for j in range(out.shape[0]):
        out[j] = src[j]


@njit(cache=True, error_model="numpy")
def _load_tile(records, kind, table, b, per_block, e0, n, tile):
    """tile[i] = key of entry e0 + i of sequence b for i < n; zeros up to the next block of 4."""
    for i in range(n):
        e = e0 + i
        slot = table[b, e // per_block] * per_block + e % per_block
        if kind == 2:
            _fp4_index_row(records[slot], tile[i])
        elif kind == 1:
            _bf16_row(records[slot], tile[i])
        else:
            _fp32_row(records[slot], tile[i])
    for i in range(n, min(tile.shape[0], (n + _BLOCK - 1) // _BLOCK * _BLOCK)):
        tile[i, :] = 0.0


# ---- scores: 4 x 4 dot blocks, epilogue in the reference's op order --------------------------------


@njit(cache=True, error_model="numpy")
def _score_tile(q, w, hi, tile, n, scale, dots, out):
    """out[e] = Σ_h w[h] · (ReLU(q[h] · tile[e]) · scale) for e < n, h in increasing order.

    q [Hi4, dI] (Hi padded to a multiple of 4 with rows that are never added), w [Hi]; dots
    [Hi4, TILE] scratch. The epilogue runs along e (vectorised; no reassociation needed)."""
    for r0 in range(0, q.shape[0], _BLOCK):
        for j0 in range(0, n, _BLOCK):
            dot4x4(q[r0], q[r0 + 1], q[r0 + 2], q[r0 + 3], tile[j0], tile[j0 + 1], tile[j0 + 2], tile[j0 + 3],
                   F32(1.0), dots, r0, j0)
    out[:n] = 0.0
    for h in range(hi):
        wh = w[h]
        row = dots[h, :n]
        for e in range(n):
            x = row[e]
            relu = F32(0.0) if x < 0.0 else x                   # NaN stays NaN (torch.relu)
            out[e] += wh * F32(relu * scale)


# ---- selection --------------------------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _order_key(score, e):
    """Unique key, larger = ranked first: score order (NaN as -inf, -0 as +0), then lower e."""
    s = F32(-np.inf) if score != score else score
    u = f32_bits(F32(0.0) if s == 0.0 else s)
    ordered = U32(~u) if u >= _SIGN else U32(u | _SIGN)
    return U64(U64(ordered) << U64(32)) | U64(_LOW32 - U64(e))


@njit(cache=True, error_model="numpy")
def _sift_down(heap, size, i):
    """Restore the min-heap order of heap[:size] below position i."""
    while True:
        c = 2 * i + 1
        if c >= size:
            return
        if c + 1 < size and heap[c + 1] < heap[c]:
            c += 1
        if heap[i] <= heap[c]:
            return
        heap[i], heap[c] = heap[c], heap[i]
        i = c


@njit(cache=True, error_model="numpy")
def _select(scores, n, keys, picked):
    """picked[:] = the top len(picked) entries of scores[:n], best first, then -1.

    A min-heap of the best m = min(n, k) keys in keys[:m] (a key beating the root replaces it),
    then heapsort, which leaves keys[:m] best first. The keys are unique, so this picks exactly
    what a full sort would; numba's np.partition + np.sort on uint64 took ~11 s to compile cold."""
    k = picked.shape[0]
    m = min(n, k)
    for e in range(m):
        keys[e] = _order_key(scores[e], e)
    for i in range(m // 2 - 1, -1, -1):
        _sift_down(keys, m, i)
    for e in range(m, n):
        key = _order_key(scores[e], e)
        if key > keys[0]:
            keys[0] = key
            _sift_down(keys, m, 0)
    for end in range(m - 1, 0, -1):                 # the smallest to the back, one at a time
        keys[0], keys[end] = keys[end], keys[0]
        _sift_down(keys, end, 0)
    for i in range(m):
        picked[i] = np.int64(_LOW32 - (keys[i] & _LOW32))
    picked[m:] = -1


@njit(cache=True, error_model="numpy")
def _limit(length, position, ratio, e_max):
    """Entries a query at ``position`` sees: min(n_b, (p + 1) // m), never past the entry axis."""
    return min(length, max(position + 1, 0) // ratio, e_max)


@njit(cache=True, error_model="numpy")
def _sequence(b, q, w, hi, records, kind, table, per_block, lengths, positions, ratio, e_max, scale, idx, slots,
              tile, dots, scores, keys, picked):
    """Sequence b: its widest row's entries scored tile by tile for all its rows (the keys are
    decoded once), then each row's top-k and their slots."""
    t_n = positions.shape[1]
    widest = 0
    for t in range(t_n):
        widest = max(widest, _limit(lengths[b], positions[b, t], ratio, e_max))
    for e0 in range(0, widest, _TILE):
        n = min(_TILE, widest - e0)
        _load_tile(records, kind, table, b, per_block, e0, n, tile)
        for t in range(t_n):
            _score_tile(q[b, t], w[b, t], hi, tile, n, scale, dots, scores[t, e0:e0 + n])
    for t in range(t_n):
        _select(scores[t], _limit(lengths[b], positions[b, t], ratio, e_max), keys, picked)
        for i in range(picked.shape[0]):
            e = picked[i]
            idx[b, t, i] = e
            slots[b, t, i] = -1 if e < 0 else table[b, e // per_block] * per_block + e % per_block


@njit(cache=True, error_model="numpy")
def _indexer_topk(q_arg, w_arg, hi, records_arg, kind, table_arg, per_block, lengths_arg, positions_arg, ratio, e_max,
                  scale, idx_arg, slots_arg, tile_arg, dots_arg, scores_arg, keys_arg, picked_arg):
    """q [B, t, Hi4, dI] fp32, w [B, t, Hi] fp32, records [S, record] uint8 (one per slot),
    table [B, F] int64, lengths [B], positions [B, t] -> idx, slots int32 [B, t, k].

    Scratch from the caller: tile [TILE, dI], dots [Hi4, TILE], scores [t, >= widest] fp32,
    keys [>= widest] uint64, picked [k] int64. Every array is ``borrow``-ed: the many small
    slices then cost no reference counting (which otherwise took as long as the dots).

    Serial over sequences: a prange over them measured no faster at one thread, and slower at
    two on a shared 2-core machine (parallel-region start-up next to torch's OpenMP pool)."""
    q, w, records, table = borrow(q_arg), borrow(w_arg), borrow(records_arg), borrow(table_arg)
    lengths, positions, idx, slots = borrow(lengths_arg), borrow(positions_arg), borrow(idx_arg), borrow(slots_arg)
    tile, dots, scores, keys = borrow(tile_arg), borrow(dots_arg), borrow(scores_arg), borrow(keys_arg)
    picked = borrow(picked_arg)
    for b in range(positions.shape[0]):
        _sequence(b, q, w, hi, records, kind, table, per_block, lengths, positions, ratio, e_max, scale, idx, slots,
                  tile, dots, scores, keys, picked)


# ---- torch-facing wrapper -------------------------------------------------------------------------

def _records(pool: torch.Tensor, fmt: str, dim: int) -> np.ndarray:
    """The pool as uint8 records [slots, record bytes] (zero-copy)."""
    if fmt == "fp4_index":
        f = get_format(fmt, dim)
        if pool.dtype != torch.uint8 or pool.dim() != 3 or pool.shape[2] != f.record_bytes:
            raise ValueError(f"fp4_index pool must be uint8 [.., R, {f.record_bytes}], got {pool.dtype} "
                             f"{tuple(pool.shape)}")
    elif pool.dtype != (torch.float32 if fmt == "fp32" else torch.bfloat16) or pool.dim() != 3 \
            or pool.shape[2] != dim:
        raise ValueError(f"{fmt} pool must be [.., R, {dim}] of {fmt}, got {pool.dtype} {tuple(pool.shape)}")
    flat = pool.contiguous().view(torch.uint8)
    return flat.view(-1, flat.shape[-1]).numpy()


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt: str, block_table: torch.Tensor,
                 lengths: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int,
                 max_entries: int | None = None, precision: str = "ieee", chunk: int = 1024,
                 weight_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k entries per decode query -> (entry indices, slots), int32 [B, q, topk], -1 padded.

    Arguments as kernels/triton/indexer_topk.py's ``indexer_topk`` (``precision`` and ``chunk``
    are Triton tuning knobs, unused here). CPU tensors.
    """
    if fmt not in _KINDS:
        return indexer_topk_reference(q, weights, pool, fmt, block_table, lengths, positions, ratio, topk,
                                      max_entries, precision, chunk, weight_scale)
    _check(q, weights, block_table, lengths, positions, ratio, topk)
    b, t, hi, di = q.shape
    per_block = pool.shape[1]
    addressable = block_table.shape[1] * per_block
    e_max = addressable if max_entries is None else max_entries
    if e_max > addressable:
        raise ValueError(f"max_entries {e_max} exceeds the table's {addressable} addressable entries")
    records = _records(pool, fmt, di)
    qf = q.float()
    if hi % _BLOCK:                                                  # pad heads to the micro-kernel's 4
        qf = torch.nn.functional.pad(qf, (0, 0, 0, _BLOCK - hi % _BLOCK))
    w = weights.float() * weight_scale                               # [B, q, Hi], as the reference forms it
    idx = torch.empty(b, t, topk, dtype=torch.int32)
    slots = torch.empty_like(idx)
    hi4 = qf.shape[2]
    widest = max(0, min(int(lengths.max()), (int(positions.max()) + 1) // ratio, e_max)) if b * t else 0
    scratch = (np.empty((_TILE, di), np.float32), np.empty((hi4, _TILE), np.float32),
               np.empty((t, max(widest, 1)), np.float32), np.empty(max(widest, 1), np.uint64),
               np.empty(topk, np.int64))
    _indexer_topk(qf.contiguous().numpy(), w.contiguous().numpy(), hi, records, _KINDS[fmt],
                  block_table.long().contiguous().numpy(), per_block, lengths.long().contiguous().numpy(),
                  positions.long().contiguous().numpy(), ratio, e_max, F32(di**-0.5), idx.numpy(), slots.numpy(),
                  *scratch)
    return idx, slots
