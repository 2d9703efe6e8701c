"""The whole static decode step on CPU as one jitted call: the CPU's analogue of a captured graph.

engine/v4/fused_decode.py's static forward launches ~100 ops a layer from Python; on a CPU nothing
hides their dispatch (a batch-1 step of a small model spent most of its time there, not in the
kernels). Here `run_step` runs the step from the embedding to the logits inside numba, over a
program that kernels/cpu_step_plan.py builds once per static shape: int64 tables of array
indices, sizes and flags (kernels/cpu_step_layout.py names the columns), typed lists of the
arrays (weights, KV pools, RoPE tables, output buffers; numpy views of the tensors, so in-place
updates are seen), and the shape's `DecodeBatch` buffer, whose contents change between steps while
its address does not, as a CUDA graph's inputs.

Per layer it calls the kernels the op path calls, with the same arguments: kernels/cpu_mhc.py
(mix, expand), cpu_norm_compress.py (norm + RoPE + window write, compressor), cpu_indexer.py,
cpu_attention.py, the FP8 / FP4 / dense row kernels (kernels/cpu_step_linear.py) and the MoE of
kernels/cpu_step_moe.py, then the head. The slot tables come from kernels/cpu_step_tables.py. So
the streams equal the op path's bit for bit wherever the op path stays on those kernels (rows
within the row kernels' limits: every batch-1 step); its torch fallbacks past the limits, the
head's collapse dot and the router's softplus are the only differences (fp32 ulps; see
cpu_step_linear.py, cpu_step_moe.py, cpu_step_math.py).

This module's compiled code carries the kernels of the modules above inlined:
kernels/cpu_cache.py stamps it with all their sources, so an edit to any of them recompiles it
(`ringserve warm-kernels` does that at install).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu_attention import _decode_parallel, _decode_serial, _split
from kernels.cpu_indexer import _indexer_topk
from kernels.cpu_mhc import _expand_kernel, _mix_kernel
from kernels.cpu_norm_compress import _compressor_kernel, _norm_rope_kernel
from kernels.cpu_numerics import F32
from kernels.cpu_sampling import PARALLEL_GREEDY_ROWS, greedy_rows, greedy_rows_parallel
from kernels.cpu_step_layout import (ATTN_NORM, ATTN_SCALE, BAD_KEYS, BAD_SLOT, BAD_TOKEN, BLOCK, C_APE, C_DIM,
                                     C_ENTRIES, C_EPS, C_NORM, C_OVERLAP, C_SPAN_SLOT, C_STATE, C_WIDTH, CHUNK,
                                     COMP_C_C, COMP_C_P, COMP_COS, COMP_SIN, COMP_Z_C, COMP_Z_P, EMBED, EPS, FFN_NORM,
                                     HC, HIDDEN, HC_A_BASE, HC_A_FN, HC_A_SCALE, HC_EPS, HC_F_BASE, HC_F_FN, HC_F_SCALE, HEAD,
                                     HEAD_BASE, HEAD_DIM, HEAD_FN, HEAD_SCALE, HEADS, I_APE, I_DIM, I_EPS,
                                     I_HEADS, I_KEY_RECORDS, I_KEYS, I_KEYS_PER_BLOCK, I_NORM, I_SPAN_SLOT, I_STATE,
                                     I_TOPK, I_WIDTH, IDX_C_C, IDX_C_P, IDX_W_C, IDX_W_P, IDX_Z_C, IDX_Z_P, INDEX_SCALE,
                                     INDEX_WEIGHT_SCALE, INDEXED, IQ_C, IQ_P, ITERS, KIND, KV_C, KV_NORM, KV_P, LANES,
                                     MAIN_COS, MAIN_SIN, NORM, OK, Q, Q_C, Q_LORA, Q_LORA_C, Q_LORA_P, Q_NORM, Q_P,
                                     QI_0, QI_COUNT, RATIO, RATIO_SLOT, ROPE, ROPE_MAIN, S_EPS, S_HC_EPS, SEQS, SINK, SOFTPLUS_CHUNK,
                                     SWA, THREADS, TORCH_THREADS, WINDOW, WINDOW_LEN, WO_A, WO_B, WO_GROUPS, WQ_B, X_0, X_COUNT)
from kernels.cpu_step_linear import N, grouped, linear
from kernels.cpu_step_moe import head, moe
from kernels.cpu_step_tables import ratio_tables, rope_rows, span_rows, window_tables


@njit(cache=True, error_model="numpy")
def _products(lin, ids, x, arrays):
    """The outputs [T, N_p] of the products (lin rows `ids`) of one input x [T, K]."""
    outs = []
    for p in range(ids.shape[0]):
        out = np.empty((x.shape[0], lin[ids[p], N]), np.float32)
        linear(lin, ids[p], x, out, arrays)
        outs.append(out)
    return outs


@njit(cache=True, error_model="numpy")
def _member(outs, product, column, width):
    """Columns [column, column + width) of product `product`'s output, as a contiguous [T, width]."""
    src = outs[product]
    out = np.empty((src.shape[0], width), np.float32)
    for t in range(src.shape[0]):
        out[t] = src[t, column:column + width]
    return out


@njit(cache=True, error_model="numpy")
def _pair_rows(c, z, b_n, q):
    """[C | Z] as [B, q, 2w] (the compressor's raw rows)."""
    w = c.shape[1]
    rows = np.empty((b_n, q, 2 * w), np.float32)
    for r in range(c.shape[0]):
        rows[r // q, r % q, :w] = c[r]
        rows[r // q, r % q, w:] = z[r]
    return rows


@njit(cache=True, error_model="numpy")
def _norm_rope(x, norm, w, eps, cos, sin, inverse, lanes):
    """kernels.norm_rope on fp32 x [T, H, D] without a pool write."""
    out = np.empty(x.shape, np.float32)
    _norm_rope_kernel(x, norm, w, eps, cos, sin, inverse, False, False, out, np.zeros((1, 1), np.float32), 0,
                      np.zeros(1, np.int64), lanes)
    return out


@njit(cache=True, error_model="numpy")
def _source(rows):
    """A value source of fp32 rows for kernels/cpu_attention.py (no bf16 bits)."""
    return np.zeros((0, 1), np.int16), rows


@njit(cache=True, error_model="numpy")
def _indexer(layer, layer_f, li, iq, w_raw, arrays, full_table, counts, positions, ratio, lanes):
    """The indexer's picks for queries iq [B·q, Hi, dI]: entry slots int32 [B·q, k]
    (kernels/cpu_indexer.py's indexer_topk)."""
    b_n, q = positions.shape
    hi, di, topk = layer[li, I_HEADS], layer[li, I_DIM], layer[li, I_TOPK]
    hi4 = (hi + 3) // 4 * 4
    qf = np.zeros((b_n, q, hi4, di), np.float32)                            # heads padded to 4
    for r in range(b_n * q):
        qf[r // q, r % q, :hi] = iq[r]
    wscale = F32(layer_f[li, INDEX_WEIGHT_SCALE])
    w = np.empty((b_n, q, hi), np.float32)
    for r in range(b_n * q):
        for h in range(hi):
            w[r // q, r % q, h] = w_raw[r, h] * wscale
    per_block = layer[li, I_KEYS_PER_BLOCK]
    e_max = full_table.shape[1] * per_block
    widest = 0
    for b in range(b_n):
        for j in range(q):
            widest = max(widest, min(counts[b], max(positions[b, j] + 1, 0) // ratio, e_max))
    idx = np.empty((b_n, q, topk), np.int32)
    slots = np.empty((b_n, q, topk), np.int32)
    width = max(widest, 1)
    _indexer_topk(qf, w, hi, arrays[3][layer[li, I_KEY_RECORDS]], 0, full_table, per_block, counts, positions, ratio, e_max,
                  F32(layer_f[li, INDEX_SCALE]), idx, slots, np.empty((64, di), np.float32),
                  np.empty((hi4, 64), np.float32), np.empty((q, width), np.float32), np.empty(width, np.uint64),
                  np.empty(topk, np.int64))
    return slots.reshape(b_n * q, topk)


@njit(cache=True, error_model="numpy")
def _attention(layer, layer_f, li, x, cos, sin, tables, lin, grp, arrays, lanes, threads, y):
    """y [T, D] = the attention of x [T, D] (FusedDecoder.attention). Returns a status."""
    f1, f2 = arrays[0], arrays[1]
    (positions, writes, window_slots, full_table, rows, completes, counts, ecos, esin, visible) = tables
    t, (b_n, q) = x.shape[0], positions.shape
    eps = layer_f[li, EPS]
    outs = _products(lin, layer[li, X_0:X_0 + layer[li, X_COUNT]], x, arrays)
    r = layer[li, Q_LORA]
    q_lora = _member(outs, layer[li, Q_LORA_P], layer[li, Q_LORA_C], r)
    q_res = _norm_rope(q_lora.reshape(t, 1, r), 1, f1[layer[li, Q_NORM]], eps, np.zeros((1, 0), np.float32),
                       np.zeros((1, 0), np.float32), False, lanes).reshape(t, r)
    heads, hd = layer[li, HEADS], layer[li, HEAD_DIM]
    kv_raw = _member(outs, layer[li, KV_P], layer[li, KV_C], hd)
    kv = np.empty((t, 1, hd), np.float32)
    window = f2[layer[li, WINDOW]]
    if _norm_rope_kernel(kv_raw.reshape(t, 1, hd), 1, f1[layer[li, KV_NORM]], eps, cos, sin, False, False, False, kv,
                         window, 1, writes, lanes) != 0:
        return BAD_SLOT
    indexed = layer[li, INDEXED] != 0
    q_outs = outs
    if indexed:
        q_outs = _products(lin, layer[li, QI_0:QI_0 + layer[li, QI_COUNT]], q_res, arrays)
        q_all = _member(q_outs, layer[li, Q_P], layer[li, Q_C], heads * hd)
    else:
        q_all = np.empty((t, heads * hd), np.float32)
        linear(lin, layer[li, WQ_B], q_res, q_all, arrays)
    qh = _norm_rope(q_all.reshape(t, heads, hd), 2, np.zeros(1, np.float32), eps, cos, sin, False, lanes)
    esrc, etab = _source(window), np.empty((t, 0), np.int32)
    if layer[li, KIND] != SWA:
        ratio, rs = layer[li, RATIO], layer[li, RATIO_SLOT]
        cw = layer[li, C_WIDTH]
        comp_rows = _pair_rows(_member(outs, layer[li, COMP_C_P], layer[li, COMP_C_C], cw),
                               _member(outs, layer[li, COMP_Z_P], layer[li, COMP_Z_C], cw), b_n, q)
        entries = f2[layer[li, C_ENTRIES]]
        if _compressor_kernel(comp_rows, f2[layer[li, C_APE]], positions, True, f2[layer[li, C_STATE]],
                              rows[layer[li, C_SPAN_SLOT]], entries, 1, np.zeros((1, 1), np.float32), completes[rs],
                              f1[layer[li, C_NORM]], layer_f[li, C_EPS], ecos[rs], esin[rs], ratio,
                              layer[li, C_OVERLAP] != 0, False, lanes) != 0:
            return BAD_SLOT
        if layer[li, I_KEYS] >= 0:
            iw = layer[li, I_WIDTH]
            idx_rows = _pair_rows(_member(outs, layer[li, IDX_C_P], layer[li, IDX_C_C], iw),
                                  _member(outs, layer[li, IDX_Z_P], layer[li, IDX_Z_C], iw), b_n, q)
            if _compressor_kernel(idx_rows, f2[layer[li, I_APE]], positions, True, f2[layer[li, I_STATE]],
                                  rows[layer[li, I_SPAN_SLOT]], f2[layer[li, I_KEYS]], 1,
                                  np.zeros((1, 1), np.float32), completes[rs], f1[layer[li, I_NORM]],
                                  layer_f[li, I_EPS], ecos[rs], esin[rs], ratio, True, False, lanes) != 0:
                return BAD_SLOT
        esrc = _source(entries)
        if indexed:
            hi, di = layer[li, I_HEADS], layer[li, I_DIM]
            iq = _norm_rope(_member(q_outs, layer[li, IQ_P], layer[li, IQ_C], hi * di).reshape(t, hi, di), 0,
                            np.zeros(1, np.float32), 0.0, cos, sin, False, lanes)
            etab = _indexer(layer, layer_f, li, iq,
                            _member(outs, layer[li, IDX_W_P], layer[li, IDX_W_C], hi), arrays, full_table, counts[rs],
                            positions, ratio, lanes)
        else:
            etab = visible[rs]
    o = np.empty((t, heads, hd), np.float32)                                  # [B·q, H, hd]
    args = (_source(qh.reshape(t * heads, hd)), f1[layer[li, SINK]], _source(window), window_slots, esrc, etab,
            _source(kv.reshape(t, hd)), True, F32(layer_f[li, ATTN_SCALE]), o)
    if threads == 1 or t * heads == 1:
        misses = _decode_serial(q, *args)
    else:
        groups, chunks = _split(t, heads, threads)
        misses = _decode_parallel(q, groups, chunks, *args)
    if misses:
        return BAD_KEYS
    o = _norm_rope(o, 0, np.zeros(1, np.float32), eps, cos, sin, True, lanes)
    g = layer[li, WO_GROUPS]
    width = heads * hd // g
    grouped_rows = np.empty((g * t, width), np.float32)                       # [G·T, I], group-major
    flat = o.reshape(t, heads * hd)
    for gi in range(g):
        for r in range(t):
            grouped_rows[gi * t + r] = flat[r, gi * width:(gi + 1) * width]
    ends = np.empty(g, np.int64)
    for gi in range(g):
        ends[gi] = (gi + 1) * t
    out_g = np.zeros((g * t, grp[layer[li, WO_A], N]), np.float32)            # [G·T, O]
    grouped(grp, layer[li, WO_A], grouped_rows, ends, out_g, arrays)
    o_lora = out_g.shape[1]
    low = np.empty((t, g * o_lora), np.float32)                               # [T, G·O]
    for gi in range(g):
        for r in range(t):
            low[r, gi * o_lora:(gi + 1) * o_lora] = out_g[gi * t + r]
    linear(lin, layer[li, WO_B], low, y, arrays)
    return OK


@njit(cache=True, error_model="numpy")
def _mix(streams, fn, base, scale, norm, step, step_f, layer_f, li):
    """One mHC site with the block's RMSNorm: (post [T, n], comb [T, n, n], x [T, D])."""
    t, n, d = streams.shape[0], step[HC], step[HIDDEN]
    pre, post = np.empty((t, n), np.float32), np.empty((t, n), np.float32)
    comb, x = np.empty((t, n, n), np.float32), np.empty((t, d), np.float32)
    _mix_kernel(streams, fn, base, scale, step[ITERS], layer_f[li, HC_EPS], layer_f[li, EPS], True, norm, True,
                layer_f[li, EPS], pre, post, comb, x, step[LANES])
    return post, comb, x


@njit(cache=True, error_model="numpy")
def _step_tables(step, step_ratios, step_spans, batch, f2):
    """The step's slot tables, built once for every layer (kernels/cpu_step_tables.py)."""
    b_n, q = step[SEQS], step[Q]
    t = b_n * q
    token_ids, positions, start, full_table, sliding_table, sliding_first = batch
    block = step[BLOCK]
    writes = np.empty(t, np.int64)
    window_slots = np.empty((t, step[WINDOW_LEN] - 1), np.int32)
    window_tables(positions, start, sliding_table, sliding_first, block, step[WINDOW_LEN], writes, window_slots)
    rows = [np.empty((b_n, step_spans[s] - 1 + q), np.int64) for s in range(step_spans.shape[0])]
    for s in range(step_spans.shape[0]):
        span_rows(start, sliding_table, sliding_first, block, step_spans[s], q, rows[s])
    comp_cos, comp_sin = f2[step[COMP_COS]], f2[step[COMP_SIN]]
    n_ratios, half = step_ratios.shape[0], comp_cos.shape[1]
    completes = [np.empty((b_n, q), np.int64) for _ in range(n_ratios)]
    counts = [np.empty(b_n, np.int64) for _ in range(n_ratios)]
    ecos = [np.empty((b_n, q, half), np.float32) for _ in range(n_ratios)]
    esin = [np.empty((b_n, q, half), np.float32) for _ in range(n_ratios)]
    visible = [np.empty((t, step_ratios[r, 1]), np.int32) for r in range(n_ratios)]
    entry_pos = np.empty((b_n, q), np.int64)
    for r in range(n_ratios):
        ratio_tables(positions, start, full_table, block, step_ratios[r, 0], completes[r], counts[r], entry_pos,
                     visible[r])
        rope_rows(comp_cos, comp_sin, entry_pos.ravel(), ecos[r].reshape(t, half), esin[r].reshape(t, half))
    return (token_ids, positions.reshape(b_n, q), writes, window_slots, full_table, rows, completes, counts, ecos,
            esin, visible)


@njit(cache=True, error_model="numpy")
def run_step(layer, layer_f, step, step_f, step_ratios, step_spans, lin, grp, arrays, batch, streams_out, logits,
             with_logits, steps, live, greedy):
    """The decode step: streams_out [T, n·D] (the final streams) and, with_logits, logits [T, V].
    batch: the DecodeBatch's views (token_ids, positions, start, full_table, sliding_table,
    sliding_first). arrays: the typed lists (f1, f2, f3, u2, u3, i2, h2, h3; kernels/cpu_step_layout.py).
    Returns a status (kernels/cpu_step_layout.py).

    steps ≥ 1 (q = 1 only): greedy decode of up to `steps` steps in this one call (`greedy_steps`);
    steps = 0: one step, its logits for the caller to sample."""
    if steps == 0:
        return _forward(layer, layer_f, step, step_f, step_ratios, step_spans, lin, grp, arrays, batch, streams_out,
                        logits, with_logits)
    return greedy_steps(layer, layer_f, step, step_f, step_ratios, step_spans, lin, grp, arrays, batch, streams_out,
                        logits, steps, live, greedy)


@njit(cache=True, error_model="numpy")
def greedy_steps(layer, layer_f, step, step_f, step_ratios, step_spans, lin, grp, arrays, batch, streams_out, logits,
                 steps, live, greedy):
    """Up to `steps` greedy decode steps of a q = 1 batch, each step's input token the argmax of
    the step before, as that many calls with the host's argmax between them would run (the
    same kernels on the same tables: the tokens and logits are theirs bit for bit).
    greedy = (tokens [T, steps'] int64, finite [T] bool, stops [T, S] int64, done [1] int64):
    tokens[r, k] is live row r's argmax at step k (kernels/cpu_sampling.py's: torch's first
    maximum); finite[r] whether every logit it saw was finite; stops[r] token ids (−1 padding)
    after which row r's request ends. The call stops after the first step in which a live row
    produced a stop id or a non-finite logit, or after `steps`; done[0] = the steps run. Rows
    ≥ live are padding: they keep their token and position. Between steps the batch's own
    token ids, positions and starts move on (the caller's tables must reach start + steps)."""
    tokens, finite, stops, done = greedy
    token_ids, positions, start = batch[0], batch[1], batch[2]
    done[0] = 0
    finite[:live] = True
    rows = np.arange(live)
    token = np.empty(live, np.int64)
    ok = np.empty(live, np.bool_)
    for k in range(steps):
        status = _forward(layer, layer_f, step, step_f, step_ratios, step_spans, lin, grp, arrays, batch, streams_out,
                          logits, True)
        if status != OK:
            return status
        if live >= PARALLEL_GREEDY_ROWS:
            greedy_rows_parallel(logits, rows, token, ok)
        else:
            greedy_rows(logits, rows, token, ok)
        done[0] = k + 1
        ended = False
        for r in range(live):
            tokens[r, k] = token[r]
            if not ok[r]:
                finite[r] = False
                ended = True
            for s in range(stops.shape[1]):
                ended |= stops[r, s] == token[r]
        if ended:
            break
        if k + 1 < steps:
            for r in range(live):
                token_ids[r] = token[r]
                positions[r] += 1
                start[r] += 1
    return OK


@njit(cache=True, error_model="numpy")
def _forward(layer, layer_f, step, step_f, step_ratios, step_spans, lin, grp, arrays, batch, streams_out, logits,
             with_logits):
    """One step: run_step's with steps = 0."""
    f1, f2 = arrays[0], arrays[1]
    (token_ids, positions, writes, window_slots, full_table, rows, completes, counts, ecos, esin,
     visible) = _step_tables(step, step_ratios, step_spans, batch, f2)
    t, n, d = token_ids.shape[0], step[HC], streams_out.shape[1] // step[HC]
    embed = f2[step[EMBED]]
    streams = np.empty((t, n * d), np.float32)
    for r in range(t):
        tok = token_ids[r]
        if tok < 0 or tok >= embed.shape[0]:
            return BAD_TOKEN
        for k in range(n):
            streams[r, k * d:(k + 1) * d] = embed[tok]
    flat_pos = positions.ravel()
    half = f2[step[MAIN_COS]].shape[1]
    main_cos, main_sin = np.empty((t, half), np.float32), np.empty((t, half), np.float32)
    rope_rows(f2[step[MAIN_COS]], f2[step[MAIN_SIN]], flat_pos, main_cos, main_sin)
    comp_cos, comp_sin = np.empty((t, half), np.float32), np.empty((t, half), np.float32)
    rope_rows(f2[step[COMP_COS]], f2[step[COMP_SIN]], flat_pos, comp_cos, comp_sin)
    tables = (positions, writes, window_slots, full_table, rows, completes, counts, ecos, esin, visible)
    lanes = step[LANES]
    y = np.empty((t, d), np.float32)
    for li in range(layer.shape[0]):
        post, comb, x = _mix(streams, f2[layer[li, HC_A_FN]], f1[layer[li, HC_A_BASE]], f1[layer[li, HC_A_SCALE]],
                             f1[layer[li, ATTN_NORM]], step, step_f, layer_f, li)
        cos, sin = (main_cos, main_sin) if layer[li, ROPE] == ROPE_MAIN else (comp_cos, comp_sin)
        status = _attention(layer, layer_f, li, x, cos, sin, tables, lin, grp, arrays, lanes, step[THREADS], y)
        if status != OK:
            return status
        mixed = np.empty((t, n * d), np.float32)
        _expand_kernel(streams, y, post, comb, mixed)
        post, comb, x = _mix(mixed, f2[layer[li, HC_F_FN]], f1[layer[li, HC_F_BASE]], f1[layer[li, HC_F_SCALE]],
                             f1[layer[li, FFN_NORM]], step, step_f, layer_f, li)
        status = moe(layer, layer_f, li, x, token_ids, lin, grp, arrays, step[CHUNK], step[SOFTPLUS_CHUNK],
                     step[TORCH_THREADS], y)
        if status != OK:
            return status
        _expand_kernel(mixed, y, post, comb, streams)
    streams_out[:] = streams
    if with_logits:
        head(streams, f2[step[HEAD_FN]], f1[step[HEAD_BASE]], f1[step[HEAD_SCALE]], f1[step[NORM]], lin, step[HEAD],
             arrays, step_f[S_HC_EPS], step_f[S_EPS], step_f[S_EPS], lanes, logits)
    return OK
