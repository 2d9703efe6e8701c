"""CPU (numba) decode attention over paged KV: window keys + picked entries + the step's own keys + a
per-head sink, the op of kernels/triton/sparse_mla_decode.py with its signature and semantics (its
module docstring and torch reference define them).

Why a kernel: at decode shapes (B = 1, H = 16, D = 512, a few hundred keys) the torch reference
spends ~0.4-2 ms in dispatch and in materialising gathered keys and [B, q, H, L]
logits; here each (token, head) row streams its keys through an online softmax seeded with the
sink (m = s_h, l = 1), so nothing larger than one key block is ever written.

Layout of the work: one task owns one query row (sequence b, token t) and a range of its heads.
It walks the row's slot tables column by column (window, then entries, then the step's keys
0..t as one stream), skipping −1, and decodes the next BLOCK valid keys into an fp32 block kb
(raw bf16 pools are read straight from the pool by slot: bf16 → fp32 is `bits << 16`); every
head then takes one online-softmax step over kb: logits by 4-head × 4-key tiles, then
acc = acc·α + Σ p·k over the block in one pass. A shared table (``*_shared``) is, row by row,
just a table whose other rows' keys are −1, so rows never meet a key they do not see: a masked
row cannot be poisoned by a NaN record, and shared and per-row reads give the same bits.
Quantized pools (fp8_ds_mla, fp4_kv, fp4_index) and fp16 pools are first gathered into an fp32
scratch of only the slots the step reads (once per sequence for a shared table, its union
column) and attended the same way.

Numerics: fp32 throughout. The q·k dots and the Σ p·k accumulation are reassociated (numba
fastmath "reassoc" + "contract" only, never "nnan"/"ninf": NaN and Inf still propagate), so
results match the reference to ~1e-6 relative, not bit for bit. A row that meets a non-finite
logit (a NaN/Inf key, or an overflowing dot) returns NaN over all of D, as the Triton kernel.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import get_num_threads, njit, prange

from kernels import cpu_kv
from kernels.cpu_dots import dot4x4
from kernels.cpu_numerics import F32, U8, U32, bits_f32, borrow, f32_bits, load_bits
from kernels.decode_reference import check_sparse_mla_decode
from kernels.pool_layout import pool_args

BLOCK = 16   # keys per online-softmax step: kb is 16 × D fp32 (32 KB at D = 512, in L1)
GROUP = 4    # keys dotted / accumulated in one pass over D (a block is padded to it with zero keys)
# Reassociation (and FMA contraction) lets LLVM vectorise the dots and the accumulation over D;
# unlike full fastmath it keeps IEEE NaN / Inf semantics.
_DOT_MATH = {"reassoc", "contract"}
_INF = F32(np.inf)
_NAN = F32(np.nan)


# ---- numba kernels ----------------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _copy_row(src, dst):
    """dst[d] = fp32 value of src[d] (src float32, or int16 bf16 bits: << 16 keeps the low half)."""
    for d in range(dst.shape[0]):
        dst[d] = bits_f32(load_bits(src[d]))


@njit(cache=True, error_model="numpy")
def _rows(src):
    """Rows of a value source: (bf16 bits int16 [N, D], fp32 [N, D]), the non-empty one. One
    source type for every input keeps the kernels at one compiled variant each."""
    return src[1].shape[0] if src[1].shape[0] else src[0].shape[0]


@njit(cache=True, error_model="numpy")
def _load_row(src, i, dst):
    """dst = fp32 row i of a value source (see _rows)."""
    if src[1].shape[0]:
        _copy_row(src[1][i], dst)
    else:
        _copy_row(src[0][i], dst)


@njit(cache=True, error_model="numpy")
def _borrow_source(src):
    return borrow(src[0]), borrow(src[1])


@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH)
def _dot1x4(q0, k0, k1, k2, k3, scale, s, h, n):
    """s[h, n + j] = scale · q0 · k_j (the heads left over from 4-head tiles)."""
    a0 = a1 = a2 = a3 = F32(0)
    for d in range(q0.shape[0]):
        x = q0[d]
        a0 += x * k0[d]
        a1 += x * k1[d]
        a2 += x * k2[d]
        a3 += x * k3[d]
    s[h, n], s[h, n + 1], s[h, n + 2], s[h, n + 3] = a0 * scale, a1 * scale, a2 * scale, a3 * scale


@njit(cache=True, error_model="numpy")
def _logits(qf, kb, n_keys, scale, s):
    """s[h, n] = scale · qf[h] · kb[n] for n < n_keys (a multiple of GROUP)."""
    n_heads = qf.shape[0]
    tiled = n_heads // 4 * 4
    for n in range(0, n_keys, GROUP):
        k0, k1, k2, k3 = kb[n], kb[n + 1], kb[n + 2], kb[n + 3]
        for h in range(0, tiled, 4):
            dot4x4(qf[h], qf[h + 1], qf[h + 2], qf[h + 3], k0, k1, k2, k3, scale, s, h, n)
        for h in range(tiled, n_heads):
            _dot1x4(qf[h], k0, k1, k2, k3, scale, s, h, n)


@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH)
def _accumulate16(kb, p, alpha, acc):
    """acc = acc · alpha + Σ_n p[n] · kb[n] over a full block: acc is read and written once."""
    k0, k1, k2, k3, k4, k5, k6, k7 = kb[0], kb[1], kb[2], kb[3], kb[4], kb[5], kb[6], kb[7]
    k8, k9, k10, k11, k12, k13, k14, k15 = kb[8], kb[9], kb[10], kb[11], kb[12], kb[13], kb[14], kb[15]
    p0, p1, p2, p3, p4, p5, p6, p7 = p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]
    p8, p9, p10, p11, p12, p13, p14, p15 = p[8], p[9], p[10], p[11], p[12], p[13], p[14], p[15]
    for d in range(acc.shape[0]):
        # four short FMA chains instead of one 17 long (latency, not throughput, bounds a chain)
        s0 = acc[d] * alpha + p0 * k0[d] + p1 * k1[d] + p2 * k2[d] + p3 * k3[d]
        s1 = p4 * k4[d] + p5 * k5[d] + p6 * k6[d] + p7 * k7[d]
        s2 = p8 * k8[d] + p9 * k9[d] + p10 * k10[d] + p11 * k11[d]
        s3 = p12 * k12[d] + p13 * k13[d] + p14 * k14[d] + p15 * k15[d]
        acc[d] = (s0 + s1) + (s2 + s3)


@njit(cache=True, error_model="numpy", fastmath=_DOT_MATH)
def _accumulate4(kb, n, p, alpha, acc):
    """acc = acc · alpha + Σ_j p[n + j] · kb[n + j] over 4 keys from n."""
    k0, k1, k2, k3 = kb[n], kb[n + 1], kb[n + 2], kb[n + 3]
    p0, p1, p2, p3 = p[n], p[n + 1], p[n + 2], p[n + 3]
    for d in range(acc.shape[0]):
        acc[d] = acc[d] * alpha + p0 * k0[d] + p1 * k1[d] + p2 * k2[d] + p3 * k3[d]


@njit(cache=True, error_model="numpy")
def _accumulate(kb, n_keys, p, alpha, acc):
    """acc = acc · alpha + Σ_n p[n] · kb[n] over n < n_keys (a multiple of GROUP)."""
    if n_keys == BLOCK:
        _accumulate16(kb, p, alpha, acc)
        return
    for n in range(0, n_keys, GROUP):
        _accumulate4(kb, n, p, alpha if n == 0 else F32(1), acc)


_LOG2E = F32(1.4426950408889634)
_LN2_HI = F32(0.693145751953125)       # ln 2 split so k · _LN2_HI is exact for |k| ≤ 128
_LN2_LO = F32(1.428606765330187e-06)
_ROUND = F32(12582912.0)               # 1.5 · 2^23: adding it rounds to an integer, held in the low bits
_ROUND_BITS = U32(0x4B400000)
_EXP_MIN = F32(-87.0)                  # 2^k stays normal down to here
_EXP_MAX = F32(88.0)


@njit(cache=True, error_model="numpy")
def _exp(x0):
    """e^x for finite fp32 x, branch-free so the loops calling it vectorise (libm's expf stays a
    scalar call): x = k·ln2 + r, |r| ≤ ln2/2, e^r by a degree-6 Taylor polynomial (relative error
    < 3e-7 measured on [-87, 0]), times 2^k built from bits. No fastmath here: the rounding
    trick needs IEEE order."""
    x = min(max(x0, _EXP_MIN), _EXP_MAX)
    t = x * _LOG2E + _ROUND
    k = t - _ROUND
    r = (x - k * _LN2_HI) - k * _LN2_LO
    e = F32(1) + r * (F32(1) + r * (F32(0.5) + r * (F32(1 / 6) + r * (F32(1 / 24) + r * (F32(1 / 120)
                                                                                      + r * F32(1 / 720))))))
    biased = U32(U32(f32_bits(t) - _ROUND_BITS) + U32(127))       # k + 127 in [1, 254]
    return e * bits_f32(U32(biased << U32(23))) * F32(x0 >= _EXP_MIN)   # below: 0 (true value < 2e-38)


@njit(cache=True, error_model="numpy")
def _attend(qf, kb, nb, scale, s, p, m, l, bad, acc):
    """One online-softmax step of every head in qf [H, D] over keys kb[:nb] [nb, D].

    m, l [H]: running max and denominator; acc [H, D]: Σ p·k; bad [H]: the head met a
    non-finite logit (its row ends NaN, so its arithmetic stops)."""
    padded = (nb + GROUP - 1) // GROUP * GROUP
    for n in range(nb, padded):                     # zero keys with p = 0: exact no-ops
        kn = kb[n]
        for d in range(kn.shape[0]):
            kn[d] = F32(0)
    _logits(qf, kb, padded, scale, s)
    for h in range(qf.shape[0]):
        if bad[h]:
            continue
        sh = s[h]
        mx = m[h]
        finite = True
        for n in range(nb):
            finite &= abs(sh[n]) < _INF
            mx = max(mx, sh[n])
        if not finite:
            bad[h] = U8(1)
            continue
        alpha = _exp(m[h] - mx)
        for n in range(nb):
            p[n] = _exp(sh[n] - mx)
        total = F32(0)
        for n in range(nb):
            total += p[n]
        for n in range(nb, padded):
            p[n] = F32(0)
        l[h] = l[h] * alpha + total
        m[h] = mx
        _accumulate(kb, padded, p, alpha, acc[h])


@njit(cache=True, error_model="numpy")
def _attend_table(src, slots, nb, qf, kb, scale, s, p, m, l, bad, acc):
    """Stream one row's slot table (−1 and other negatives masked) into the key block kb, which
    holds nb pending keys; every full block takes a softmax step. Returns (pending keys, slots
    that lay beyond src and were not read)."""
    n_rows, out_of_range = _rows(src), 0
    for col in range(slots.shape[0]):
        slot = slots[col]
        if slot >= n_rows:
            out_of_range += 1
        elif slot >= 0:
            _load_row(src, slot, kb[nb])
            nb += 1
            if nb == BLOCK:
                _attend(qf, kb, BLOCK, scale, s, p, m, l, bad, acc)
                nb = 0
    return nb, out_of_range


@njit(cache=True, error_model="numpy")
def _attend_rows(task0, task1, groups, tokens, q_arg, sink_arg, wsrc_arg, wslots_arg, esrc_arg, eslots_arg,
                 new_arg, has_new, scale, out_arg, qf_arg, kb_arg, s_arg, p_arg, m_arg, l_arg, bad_arg, acc_arg):
    """Tasks task0 .. task1−1; task i is query row i // groups (sequence-major, token-minor) and
    its head group i % groups. q [rows·H, D] and new [rows, D] are value sources (_rows) like the
    key sources; scratch (qf, kb, s, p, m, l, bad, acc) is the caller's."""
    q, new = _borrow_source(q_arg), _borrow_source(new_arg)
    wsrc, esrc = _borrow_source(wsrc_arg), _borrow_source(esrc_arg)
    sink, wslots, eslots, out = borrow(sink_arg), borrow(wslots_arg), borrow(eslots_arg), borrow(out_arg)
    qf_all, kb, s_all, p = borrow(qf_arg), borrow(kb_arg), borrow(s_arg), borrow(p_arg)
    m_all, l_all, bad_all, acc_all = borrow(m_arg), borrow(l_arg), borrow(bad_arg), borrow(acc_arg)
    n_heads = out.shape[1]
    per_group = (n_heads + groups - 1) // groups
    out_of_range = 0
    for task in range(task0, task1):
        r = task // groups
        h0 = task % groups * per_group
        h1 = min(n_heads, h0 + per_group)
        hn = h1 - h0
        qf, s, acc = qf_all[:hn], s_all[:hn], acc_all[:hn]
        m, l, bad = m_all[:hn], l_all[:hn], bad_all[:hn]
        for i in range(hn):
            _load_row(q, r * n_heads + h0 + i, qf[i])
            m[i] = sink[h0 + i]                     # the sink seeds the max ...
            l[i] = F32(1)                           # ... and adds e^0 = 1 to the denominator
            bad[i] = U8(0)
            ai = acc[i]
            for d in range(ai.shape[0]):
                ai[d] = F32(0)
        # window, entries and new keys fill one stream of key blocks (one partial block per row)
        nb, missed = _attend_table(wsrc, wslots[r], 0, qf, kb, scale, s, p, m, l, bad, acc)
        nb, missed_e = _attend_table(esrc, eslots[r], nb, qf, kb, scale, s, p, m, l, bad, acc)
        out_of_range += missed + missed_e
        if has_new:                                 # token t sees the step's keys 0..t
            for j in range(r - r % tokens, r + 1):
                _load_row(new, j, kb[nb])
                nb += 1
                if nb == BLOCK:
                    _attend(qf, kb, BLOCK, scale, s, p, m, l, bad, acc)
                    nb = 0
        if nb:
            _attend(qf, kb, nb, scale, s, p, m, l, bad, acc)
        for i in range(hn):
            o, ai = out[r, h0 + i], acc[i]
            inv = _NAN if bad[i] else F32(1) / l[i]
            for d in range(o.shape[0]):
                o[d] = ai[d] * inv                  # a bad row: NaN · anything = NaN
    return out_of_range


@njit(cache=True, error_model="numpy")
def _scratch(heads, dim):
    return (np.empty((heads, dim), dtype=np.float32), np.empty((BLOCK, dim), dtype=np.float32),
            np.empty((heads, BLOCK), dtype=np.float32), np.empty(BLOCK, dtype=np.float32),
            np.empty(heads, dtype=np.float32), np.empty(heads, dtype=np.float32),
            np.empty(heads, dtype=np.uint8), np.empty((heads, dim), dtype=np.float32))


@njit(cache=True, error_model="numpy")
def _decode_serial(tokens, q, sink, wsrc, wslots, esrc, eslots, new, has_new, scale, out):
    qf, kb, s, p, m, l, bad, acc = _scratch(out.shape[1], out.shape[2])
    return _attend_rows(0, out.shape[0], 1, tokens, q, sink, wsrc, wslots, esrc, eslots, new, has_new, scale, out,
                        qf, kb, s, p, m, l, bad, acc)


@njit(parallel=True, cache=True, error_model="numpy")
def _decode_parallel(tokens, groups, n_chunks, q, sink, wsrc, wslots, esrc, eslots, new, has_new, scale, out):
    """n_chunks contiguous runs of the rows × groups tasks, one scratch set per run."""
    n_tasks = out.shape[0] * groups
    per_chunk = (n_tasks + n_chunks - 1) // n_chunks
    misses = np.zeros(n_chunks, dtype=np.int64)
    for c in prange(n_chunks):
        qf, kb, s, p, m, l, bad, acc = _scratch((out.shape[1] + groups - 1) // groups, out.shape[2])
        misses[c] = _attend_rows(c * per_chunk, min(n_tasks, (c + 1) * per_chunk), groups, tokens, q, sink, wsrc,
                                 wslots, esrc, eslots, new, has_new, scale, out, qf, kb, s, p, m, l, bad, acc)
    return misses.sum()


# ---- torch-facing wrapper -----------------------------------------------------------------------

_NO_BITS = np.zeros((0, 1), dtype=np.int16)
_NO_VALUES = np.zeros((0, 1), dtype=np.float32)


def _source(x: torch.Tensor, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """x as a kernel value source of rows [N, dim], zero-copy: (bf16 bits as int16, empty) for
    bf16, (empty, fp32) otherwise (fp16 is widened)."""
    if not x.is_contiguous():
        x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().reshape(-1, dim), _NO_VALUES
    return _NO_BITS, (x if x.dtype == torch.float32 else x.float()).numpy().reshape(-1, dim)


def _table(slots: torch.Tensor) -> np.ndarray:
    """[B, q, N] int slots -> int32 [B·q, N] (slot counts fit int32: fewer kernel variants)."""
    if slots.dtype != torch.int32 or not slots.is_contiguous():
        slots = slots.to(torch.int32).contiguous()
    b, t, n = slots.shape
    return slots.numpy().reshape(b * t, n)


def _keys(pool: torch.Tensor, fmt: str, slots: torch.Tensor, shared: bool, dim: int) -> tuple[tuple, np.ndarray]:
    """(key source of rows [N, D], slot table [B·q, cols] into them) for one pool and table.

    bf16 / fp32 pools are read in place by slot; quantized and fp16 pools are gathered into an
    fp32 scratch of only the slots the table reads (a shared table: its union column per
    sequence, once) and the table renumbered to scratch rows."""
    pool_args(pool, fmt, dim)                                       # validates layout and dtype
    if fmt in ("bf16", "fp32"):
        return _source(pool, dim), _table(slots)
    cols = slots.amax(dim=1, keepdim=True) if shared else slots       # [B, 1 or q, N]: the slots read
    flat = cols.reshape(-1).long()
    if fmt == "fp16":
        rows = pool.view(-1, dim)[flat.clamp(min=0)].float()             # [B·(1 or q)·N, D]
    else:
        rows = cpu_kv.gather_dequantize(pool, flat, fmt, torch.float32, dim)
    index = torch.arange(flat.numel(), dtype=torch.int32).view(cols.shape)
    return _source(rows, dim), _table(torch.where(slots >= 0, index, -1))


def _check(q: torch.Tensor, sink: torch.Tensor, window_slots: torch.Tensor, entry_slots: torch.Tensor | None,
           new_kv: torch.Tensor | None) -> None:
    if q.dim() != 4 or q.device.type != "cpu":
        raise ValueError(f"q must be a CPU [B, q, H, D] tensor, got {q.device} {tuple(q.shape)}")
    check_sparse_mla_decode(q, sink, window_slots, entry_slots, new_kv)


@njit(cache=True)
def _split(rows, heads, threads):
    """(head groups per row, chunks of tasks) for the parallel kernel: enough tasks for every
    thread, heads split only when there are fewer rows than threads."""
    groups = min(heads, -(-threads // rows)) if rows < threads else 1
    return groups, min(threads, rows * groups)


def sparse_mla_decode(q: torch.Tensor, sink: torch.Tensor, window_pool: torch.Tensor, window_fmt: str,
                      window_slots: torch.Tensor, entry_pool: torch.Tensor | None = None, entry_fmt: str = "fp32",
                      entry_slots: torch.Tensor | None = None, new_kv: torch.Tensor | None = None,
                      scale: float | None = None, window_shared: bool = False,
                      entries_shared: bool = False) -> torch.Tensor:
    """Sink attention of q [B, q, H, D] over window + entry records (+ new_kv) -> fp32 [B, q, H, D].

    Semantics of kernels.triton.sparse_mla_decode.sparse_mla_decode_reference: softmax over
    [window | entries | new keys 0..t | sink], K = V, logits q·k·scale (scale D^-0.5 by
    default); slot −1 masked; ``entry_pool`` None or K = 0 attends the window only; a
    ``*_shared`` table holds one slot per column for all of a sequence's rows (only used to
    gather a quantized pool once per sequence)."""
    _check(q, sink, window_slots, entry_slots, new_kv)
    b, t, h, d = q.shape
    wsrc, wtab = _keys(window_pool, window_fmt, window_slots, window_shared, d)
    if entry_pool is None or entry_slots is None or entry_slots.shape[-1] == 0:
        esrc, etab = wsrc, wtab[:, :0]
    else:
        esrc, etab = _keys(entry_pool, entry_fmt, entry_slots, entries_shared, d)
    qs = _source(q, d)
    new = qs if new_kv is None else _source(new_kv, d)                 # None: never read
    out = torch.empty(b, t, h, d, dtype=torch.float32)
    sink = sink.detach() if sink.requires_grad else sink
    args = (qs, sink.float().contiguous().numpy(), wsrc, wtab, esrc, etab, new, new_kv is not None,
            np.float32(d**-0.5 if scale is None else scale), out.numpy().reshape(b * t, h, d))
    threads = get_num_threads()
    if threads == 1 or b * t * h == 1:
        misses = _decode_serial(t, *args)
    else:
        misses = _decode_parallel(t, *_split(b * t, h, threads), *args)
    if misses:
        raise ValueError(f"{misses} slots lie beyond their pools")
    return out
