"""The compiled CPU step's MoE layer and output head (kernels/cpu_step.py runs them).

MoE, for x [T, H]: router logits by the dense row kernel, sqrt-softplus scores
(kernels/cpu_step_math.py), top-k (or the hash table's ids) and weights by kernels/cpu_routing.py's
per-token functions, the counting-sort permutation, the gathered slots, the routed w13 products
and the shared expert's [w1 | w3] rows into one [T·k + T, 2I] buffer, SwiGLU, w2 and the
shared w2, the weighted combine (kernels/cpu_moe_glue.py). That is kernels/cpu_moe_decode.py's
two-call layer with its SwiGLU inside; the SwiGLU runs over the same buffers torch's would
(one over all rows where the op path fuses the layer, `FUSED_ROWS`; the routed and the shared
rows apart where it does not), so its silu takes the path torch's takes element by element.

Head: the final mHC collapse (hc_head_collapse: the RMS-normalised streams dotted with the
head's fn rows, sigmoid, Σ pre_k·H_k), the output RMSNorm and the LM head by the row kernel.
The dot of the collapse is kernels/cpu_mhc.py's (torch's sgemm orders that sum otherwise:
fp32 ulps); the sums of squares follow torch's order (kernels/cpu_torch_sum.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels import cpu_gemv
from kernels.cpu_mhc import _collapse_token, _dot, _sigmoid
from kernels.cpu_moe_glue import _moe_combine
from kernels.cpu_norm_compress import _rms_weighted
from kernels.cpu_numerics import F32
from kernels.cpu_routing import _counting_sort, normalise_row, select_topk_row
from kernels.cpu_step_layout import (BAD_ENDS, BAD_EXPERT, BAD_HASH_TOKEN, BIAS, EXPERTS, FUSED_ROWS, GATE, GATE_PER,
                                     LIMIT_ROUTED, LIMIT_SHARED, OK, SCALING, SH_0, SH_1, SH_COUNT, SH_W2, TID2EID,
                                     TOPK, W2, W13, INTER)
from kernels.cpu_step_linear import N, grouped, linear
from kernels.cpu_step_math import router_scores, swiglu_rows
from kernels.cpu_torch_sum import ILP, LEVELS, sum_squares


@njit(cache=True, error_model="numpy")
def _route(layer, layer_f, li, scores, token_ids, arrays, ids, weights):
    """ids, weights [T, k] of every token: the hash table's ids or the top-k of scores + bias."""
    f1, i2 = arrays[0], arrays[5]
    t_count, num_experts = scores.shape
    k = ids.shape[1]
    if layer[li, TID2EID] >= 0:
        table = i2[layer[li, TID2EID]]
        for t in range(t_count):
            tok = token_ids[t]
            if tok < 0 or tok >= table.shape[0]:
                return BAD_HASH_TOKEN
            for j in range(k):
                ids[t, j] = table[tok, j]
    else:
        bias = f1[layer[li, BIAS]]
        for t in range(t_count):
            select_topk_row(scores[t], bias, k, ids[t])
    for t in range(t_count):
        for j in range(k):
            if ids[t, j] < 0 or ids[t, j] >= num_experts:
                return BAD_EXPERT
    scaling = F32(layer_f[li, SCALING])
    for t in range(t_count):
        normalise_row(scores[t], ids[t], scaling, weights[t])
    return OK


@njit(cache=True, error_model="numpy")
def _rows(a, first, count):
    """A contiguous copy of rows [first, first + count) of a."""
    out = np.empty((count, a.shape[1]), np.float32)
    for i in range(count):
        out[i] = a[first + i]
    return out


@njit(cache=True, error_model="numpy")
def moe(layer, layer_f, li, x, token_ids, lin, grp, arrays, chunk, softplus_chunk, threads, out):
    """out [T, H] = the MoE layer of x [T, H] (fp32). chunk / softplus_chunk / threads: torch's
    elementwise layout (kernels/cpu_step_math.py). Returns a status (layout.OK when done)."""
    t_count, hidden = x.shape
    num_experts, k, inter = layer[li, EXPERTS], layer[li, TOPK], layer[li, INTER]
    logits = np.empty((t_count, num_experts), np.float32)                   # [T, E]
    cpu_gemv._product(arrays[1][layer[li, GATE]], x, logits, layer[li, GATE_PER])
    scores = np.empty((t_count, num_experts), np.float32)
    router_scores(logits, scores, softplus_chunk, threads)
    ids = np.empty((t_count, k), np.int32)
    weights = np.empty((t_count, k), np.float32)
    status = _route(layer, layer_f, li, scores, token_ids, arrays, ids, weights)
    if status != OK:
        return status
    s = t_count * k
    counts, offsets = np.zeros(num_experts, np.int32), np.empty(num_experts + 1, np.int32)
    order, inverse = np.empty(s, np.int32), np.empty(s, np.int32)
    _counting_sort(ids.ravel(), num_experts, counts, offsets, order, inverse)
    ends = np.empty(num_experts, np.int64)
    for e in range(num_experts):
        ends[e] = offsets[e + 1]
    slots = np.empty((s, hidden), np.float32)                                # [T·k, H] in expert order
    for i in range(s):
        slots[i] = x[order[i] // k]
    has_shared = layer[li, SH_COUNT] > 0
    h = np.zeros((s + (t_count if has_shared else 0), 2 * inter), np.float32)   # [T·k (+ T), 2I]
    routed_h = np.zeros((s, 2 * inter), np.float32)
    if grouped(grp, layer[li, W13], slots, ends, routed_h, arrays) < 0:
        return BAD_ENDS
    h[:s] = routed_h
    if has_shared:
        shared_h = np.empty((t_count, 2 * inter), np.float32)
        if layer[li, SH_COUNT] == 1:
            linear(lin, layer[li, SH_0], x, shared_h, arrays)
        else:                                                                # w1 and w3 apart
            gate, up = np.empty((t_count, inter), np.float32), np.empty((t_count, inter), np.float32)
            linear(lin, layer[li, SH_0], x, gate, arrays)
            linear(lin, layer[li, SH_1], x, up, arrays)
            shared_h[:, :inter] = gate
            shared_h[:, inter:] = up
        h[s:] = shared_h
    act = np.empty((h.shape[0], inter), np.float32)                          # [T·k (+ T), I]
    if t_count <= layer[li, FUSED_ROWS]:
        swiglu_rows(h, layer_f[li, LIMIT_ROUTED], act, chunk, threads)
    else:
        routed_act = np.empty((s, inter), np.float32)
        swiglu_rows(routed_h, layer_f[li, LIMIT_ROUTED], routed_act, chunk, threads)
        act[:s] = routed_act
        if has_shared:
            shared_act = np.empty((t_count, inter), np.float32)
            swiglu_rows(_rows(h, s, t_count), layer_f[li, LIMIT_SHARED], shared_act, chunk, threads)
            act[s:] = shared_act
    y = np.zeros((s, hidden), np.float32)                                    # [T·k, H]
    grouped(grp, layer[li, W2], _rows(act, 0, s), ends, y, arrays)
    shared = y
    if has_shared:
        shared = np.empty((t_count, hidden), np.float32)
        linear(lin, layer[li, SH_W2], _rows(act, s, t_count), shared, arrays)
    _moe_combine(y, weights, inverse, shared, has_shared, out, np.empty(hidden, np.float32))
    return OK


@njit(cache=True, error_model="numpy")
def head(streams, fn, base, scale, norm, lin, head_row, arrays, hc_eps, norm_eps, eps, lanes, logits):
    """logits [T, V] of the final streams [T, n·D] (DeepseekV4.logits); the LM head is lin row
    head_row."""
    t_count, nd = streams.shape
    n = fn.shape[0]
    d = nd // n
    acc = np.empty((LEVELS, ILP * lanes), np.float32)
    flat = np.empty(nd, np.float32)
    pre = np.empty(n, np.float32)
    xf = np.empty(d, np.float32)
    x = np.empty((t_count, d), np.float32)
    for t in range(t_count):
        row = streams[t]
        flat[:] = row
        r = F32(1.0) / np.sqrt(sum_squares(flat, lanes, acc) / F32(nd) + F32(norm_eps))
        for i in range(nd):
            flat[i] = flat[i] * r
        for j in range(n):
            pre[j] = _sigmoid(_dot(fn[j], flat) * scale[0] + base[j]) + F32(hc_eps)
        _collapse_token(row, pre, n, d, x[t], xf)
        _rms_weighted(xf, norm, eps, False, lanes, acc)
        x[t] = xf
    linear(lin, head_row, x, logits, arrays)
