"""CPU (numba) norm_rope and compressor_step: the decode step's per-token norm/rope/pool ops.

At batch 1 the torch references of these ops (kernels/triton/norm_rope.py,
kernels/triton/compressor_step.py) cost hundreds of µs of op dispatch for microseconds of
arithmetic; here each is one jitted call behind a thin wrapper, with the same signatures and
semantics (see the reference modules for the maths and the layouts).

Numerics follow the references' rounding points: fp32 statistics and products, the compute
dtype's rounding (bf16 RNE via kernels/cpu_numerics.py) exactly where engine/v4/layers.py rounds.
The RMS sum of squares is added in the order of torch's CPU sum kernel (a contiguous inner sum:
4 interleaved vectors of ``_LANES`` lanes, a level cascade every 16 steps, lanes folded left to
right; the lane count is probed against torch at import), so norm_rope is bit-identical to its
reference. The compressor's softmax uses a
polynomial exp (``_exp``, within 2 fp32 ulps; torch's vectorised exp is another approximation),
so its entries may differ from the reference by fp32 ulps and, rarely, one bf16 ulp; the span
sum follows torch's outer-sum cascade, the state rows are exact.

bf16 tensors travel as uint16 bit views; numba compiles one specialisation per dtype/layout
combination (cached on disk). Quantized pool formats are written by kernels.cpu_kv's scatter.
The kernels inline kernels/cpu_numerics.py (kernels/cpu_cache.py recompiles them when it changes).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from kernels import cpu_kv
from kernels.cpu_numerics import F32, U16, U32, bf16_bits, bits_f32, f32_bits, load_bits, pow2, store_value
from kernels.cpu_torch_sum import ILP as _ILP
from kernels.cpu_torch_sum import LANES as _LANES
from kernels.cpu_torch_sum import LEVELS as _LEVELS
from kernels.cpu_torch_sum import sum_squares as _sum_squares
from kernels.formats import get_format
from kernels import decode_reference as _ref
from kernels import pool_layout

_RAW_KIND = {"fp32": 1, "bf16": 2, "fp16": 3}   # pool kinds the kernels write themselves (0: none)
_FLOAT = {torch.float32: False, torch.bfloat16: True}
_NO_F32 = np.zeros((1, 1), dtype=np.float32)
_NO_ROPE = np.zeros((1, 0), dtype=np.float32)              # cos/sin without rope: half = 0
_NO_F32_1D = np.zeros(1, dtype=np.float32)
_NO_I64 = np.zeros(1, dtype=np.int64)
_NO_I64_2D = np.zeros((1, 1), dtype=np.int64)
_OK, _BAD_SLOT = 0, 1


# ---- scalar helpers ---------------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _round(v, bf16):
    """fp32 v rounded to the compute dtype (bf16 RNE, NaN -> the canonical NaN) or kept."""
    if bf16:
        return bits_f32(U32(U32(bf16_bits(f32_bits(v))) << U32(16)))
    return F32(v)


@njit(cache=True, error_model="numpy")
def _fp16_bits(v):
    """fp32 -> fp16 bits, RNE, overflow to Inf, NaN -> 0x7E00 with the sign (torch's .to(half))."""
    u = f32_bits(v)
    sign = U32(U32(u >> U32(16)) & U32(0x8000))
    a = U32(u & U32(0x7FFFFFFF))
    if a > U32(0x7F800000):
        return U16(sign | U32(0x7E00))
    if a < U32(0x38800000):             # below 2^-14: a multiple of 2^-24, rounded by adding 0.5
        return U16(sign | U32(f32_bits(F32(bits_f32(a) + F32(0.5))) - U32(0x3F000000)))
    r = U32(U32(a + U32(0xFFF) + U32(U32(a >> U32(13)) & U32(1))) >> U32(13)) - U32(112 << 10)
    return U16(sign | U32(min(r, U32(0x7C00))))


@njit(cache=True, error_model="numpy")
def _rsqrt_mean(v, eps, lanes, acc):
    """1 / sqrt(mean(v²) + eps) as torch computes it (sum, true division, sqrt, division)."""
    mean = F32(_sum_squares(v, lanes, acc) / F32(v.shape[0]))
    return F32(F32(1.0) / np.sqrt(F32(mean + eps)))


@njit(cache=True, error_model="numpy")
def _to_bf16(v):
    """fp32 v rounded to bf16 (RNE, NaN -> the canonical NaN), as fp32; branch-free."""
    return bits_f32(U32(U32(bf16_bits(f32_bits(v))) << U32(16)))


@njit(cache=True, error_model="numpy")
def _load_row(src, v, to_bf16):
    """v <- src as fp32 (fp32 or bf16 bits), rounded to bf16 when to_bf16 (one loop per case:
    a per-element branch would stop vectorisation)."""
    if to_bf16:
        for j in range(v.shape[0]):
            v[j] = _to_bf16(bits_f32(load_bits(src[j])))
    else:
        for j in range(v.shape[0]):
            v[j] = bits_f32(load_bits(src[j]))


@njit(cache=True, error_model="numpy")
def _rms_weighted(v, w, eps, bf16, lanes, acc):
    """v <- round(w · (v · r)) in place (engine rms_norm; v already in the compute dtype)."""
    r = _rsqrt_mean(v, eps, lanes, acc)
    if bf16:
        for j in range(v.shape[0]):
            v[j] = _to_bf16(F32(bits_f32(load_bits(w[j])) * F32(v[j] * r)))
    else:
        for j in range(v.shape[0]):
            v[j] = F32(bits_f32(load_bits(w[j])) * F32(v[j] * r))


@njit(cache=True, error_model="numpy")
def _head_rms(v, eps, bf16, lanes, acc):
    """v <- round(v · round(r)) in place (engine head_rms_norm: the factor is rounded first)."""
    r = _rsqrt_mean(v, eps, lanes, acc)
    if bf16:
        r = _to_bf16(r)
        for j in range(v.shape[0]):
            v[j] = _to_bf16(F32(v[j] * r))
    else:
        for j in range(v.shape[0]):
            v[j] = F32(v[j] * r)


@njit(cache=True, error_model="numpy")
def _rope(v, cos, sin, inverse, bf16):
    """Interleaved pairs of v's last 2·half channels rotated in fp32 (inverse: by −θ), rounded."""
    half = cos.shape[0]
    base = v.shape[0] - 2 * half
    for i in range(half):
        c, s = F32(cos[i]), F32(sin[i])
        if inverse:
            s = -s
        e, o = v[base + 2 * i], v[base + 2 * i + 1]
        v[base + 2 * i] = _round(F32(F32(e * c) - F32(o * s)), bf16)
        v[base + 2 * i + 1] = _round(F32(F32(o * c) + F32(e * s)), bf16)


@njit(cache=True, error_model="numpy")
def _store_raw(v, pool, kind):
    """pool row <- v in the pool's raw dtype (1 fp32, 2 bf16 bits, 3 fp16 bits)."""
    if kind == 1:
        for j in range(v.shape[0]):
            pool[j] = v[j]
    elif kind == 2:
        for j in range(v.shape[0]):
            pool[j] = bf16_bits(f32_bits(v[j]))
    else:
        for j in range(v.shape[0]):
            pool[j] = _fp16_bits(v[j])


@njit(cache=True, error_model="numpy")
def _slots_in_range(slots, capacity):
    for i in range(slots.shape[0]):
        if slots[i] < -1 or slots[i] >= capacity:
            return False
    return True




# ---- norm_rope --------------------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _norm_rope_kernel(x, norm, w, eps, cos, sin, inverse, bf16, pre_round, out, pool, kind, slots, lanes):
    """x [T, H, D] (fp32 or bf16 bits) -> out [T, H, D]; head 0 of row t also to pool[slots[t]]."""
    t_n, h_n, d = x.shape
    if kind and not _slots_in_range(slots, pool.shape[0]):
        return _BAD_SLOT
    v = np.empty(d, dtype=np.float32)
    acc = np.empty((_LEVELS, _ILP * lanes), dtype=np.float32)
    rope = cos.shape[1] > 0
    for t in range(t_n):
        for h in range(h_n):
            _load_row(x[t, h], v, pre_round)
            if norm == 1:
                _rms_weighted(v, w, eps, bf16, lanes, acc)
            elif norm == 2:
                _head_rms(v, eps, bf16, lanes, acc)
            if rope:
                _rope(v, cos[t], sin[t], inverse, bf16)
            orow = out[t, h]
            for j in range(d):
                store_value(orow, j, v[j])
            if kind and h == 0 and slots[t] >= 0:
                _store_raw(v, pool[slots[t]], kind)
    return _OK


def _bits(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view: fp32 as float32, bf16 as int16 bits (load_bits / store_value take
    any 16-bit integer as bf16 bits), ints as they are."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    return t.numpy()


def _f32(t: torch.Tensor) -> np.ndarray:
    return (t if t.dtype == torch.float32 else t.float()).contiguous().numpy()


def _int64(t: torch.Tensor) -> torch.Tensor:
    """A contiguous int64 slot table (int32 tables compiled their own kernel variants)."""
    return t.to(torch.int64).contiguous()


def _raw_pool(pool: torch.Tensor, fmt: str, dim: int) -> tuple[np.ndarray, int]:
    """(pool as [slots, dim] rows, kind) for a raw pool; (None, 0) for a quantized format."""
    pool_layout.pool_args(pool, fmt, dim)                                    # validates layout and dtype
    if fmt not in _RAW_KIND:
        return None, 0
    rows = pool.view(-1, dim)
    return (rows.numpy() if fmt == "fp32" else rows.view(torch.int16).numpy()), _RAW_KIND[fmt]


def _raise_bad_slot(what: str, capacity: int) -> None:
    raise IndexError(f"{what} must be -1 or in [0, {capacity})")


def norm_rope(x: torch.Tensor, norm: int = 0, weight: torch.Tensor | None = None, eps: float = 1e-6,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, inverse: bool = False,
              dtype: torch.dtype | None = None, pre_round: bool = False, pool: torch.Tensor | None = None,
              pool_fmt: str = "fp32", slots: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H, D] -> [T, H, D] in ``dtype`` (default x.dtype); kernels/triton/norm_rope.py's op."""
    _ref.check_norm_rope(x, weight, norm, cos, sin, slots)
    dtype = x.dtype if dtype is None else dtype
    if dtype not in _FLOAT:
        raise ValueError(f"dtype must be fp32 or bf16, got {dtype}")
    t, h, d = x.shape
    if x.dtype not in _FLOAT:                                              # fp16: widen (exact)
        x = x.float()
    # One array layout and index type per dtype: every other variant is another numba compile
    # (seconds each, cold), for nothing at decode sizes (a copy of a few rows).
    x = x.contiguous()
    slots = None if slots is None else _int64(slots)
    pre_round = (pre_round or x.dtype != dtype) and dtype == torch.bfloat16 and x.dtype != torch.bfloat16
    out = torch.empty(t, h, d, dtype=dtype)
    if t == 0:
        return out
    rows, kind = (None, 0) if pool is None else _raw_pool(pool, pool_fmt, d)
    rows = _NO_F32 if rows is None else rows
    sl = _NO_I64 if pool is None else slots.numpy()
    if pool is not None and kind == 0 and not _slots_in_range(sl, pool.shape[0] * pool.shape[1]):
        _raise_bad_slot("slots", pool.shape[0] * pool.shape[1])
    status = _norm_rope_kernel(_bits(x), norm, _NO_F32_1D if weight is None else _bits(weight), eps,
                               _NO_ROPE if cos is None else _f32(cos), _NO_ROPE if sin is None else _f32(sin),
                               inverse, dtype == torch.bfloat16, pre_round, _bits(out), rows, kind, sl, _LANES)
    if status != _OK:
        _raise_bad_slot("slots", rows.shape[0])
    if pool is not None and kind == 0:
        cpu_kv.scatter_records(out[:, 0], pool, slots.long(), get_format(pool_fmt, d))
    return out


# ---- compressor_step --------------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _exp(x):
    """e^x in fp32 within 2 ulps, branch-free so the pooling loops vectorise; e^-inf = 0, NaN kept.

    x = k·ln2 + r with |r| <= ln2/2 (ln2 split in two so k·hi is exact), e^r by a degree-7
    polynomial, 2^k applied as two factors so that subnormal results and overflow come out right.
    """
    t = min(max(x, F32(-110.0)), F32(89.0))
    k = F32(F32(F32(t * F32(1.44269504)) + F32(12582912.0)) - F32(12582912.0))   # rint(t / ln2)
    r = F32(F32(t - F32(k * F32(0.693359375))) - F32(k * F32(-2.12194440e-4)))
    p = F32(1.9875691500e-4)
    p = F32(F32(p * r) + F32(1.3981999507e-3))
    p = F32(F32(p * r) + F32(8.3334519073e-3))
    p = F32(F32(p * r) + F32(4.1665795894e-2))
    p = F32(F32(p * r) + F32(1.6666665459e-1))
    p = F32(F32(p * r) + F32(5.0000001201e-1))
    y = F32(F32(F32(p * F32(r * r)) + r) + F32(1.0))
    ki = np.int32(k)
    k1 = np.int32(ki >> np.int32(1))                 # floor(k / 2)
    y = F32(F32(y * pow2(k1)) * pow2(np.int32(ki - k1)))
    return y if x == x else x


@njit(cache=True, error_model="numpy")
def _new_rows(rows, ape, positions, ratio, width, has_ape, new):
    """new [B·q, 2·width] fp32 <- [C | Z + ape[p % m]] (rows fp32 or bf16 bits)."""
    b_n, q_n, two_w = rows.shape
    for b in range(b_n):
        for j in range(q_n):
            src, dst = rows[b, j], new[b * q_n + j]
            for c in range(two_w):
                dst[c] = bits_f32(load_bits(src[c]))
            if has_ape:
                a = ape[positions[b, j] % ratio]
                g = dst[width:]
                for c in range(width):
                    g[c] = F32(g[c] + a[c])


@njit(cache=True, error_model="numpy")
def _window_row(state, new, row_slots, b, q_n, idx, s1):
    """Row idx of sequence b's window table (idx < s1: history) and whether it is missing."""
    if idx < s1:
        slot = row_slots[b, idx]
        if slot < 0:
            return state[0], True
        return state[slot], False
    return new[b * q_n + idx - s1], False


@njit(cache=True, error_model="numpy")
def _pool_entry(state, new, row_slots, b, j, q_n, s1, span, ratio, width, dim, overlap, out, scr):
    """out [dim] <- Σ_s kv_s · softmax_s(gate_s) over token j's span (torch's orders).

    Missing rows read kv 0 and gate −inf (masked_fill); the sum over s follows torch's outer
    sum: 16 rows into level 0, flushed into level 1 (and upward as 16² rows complete).
    """
    gmax, total, e, acc = scr[0], scr[1], scr[4:4 + span], scr[4 + span:8 + span]
    for c in range(dim):
        gmax[c] = -np.inf
        total[c] = F32(0.0)
    for s in range(span):
        row, miss = _window_row(state, new, row_slots, b, q_n, j + s, s1)
        off = width + (dim if overlap and s >= ratio else 0)
        g = row[off:off + dim]
        if miss:
            continue                      # max(m, −inf) = m, NaN included
        for c in range(dim):
            v = g[c]
            m = gmax[c]
            gmax[c] = v if (v > m) | (v != v) | (m != m) else m
    for s in range(span):
        row, miss = _window_row(state, new, row_slots, b, q_n, j + s, s1)
        off = width + (dim if overlap and s >= ratio else 0)
        g, es = row[off:off + dim], e[s]
        for c in range(dim):
            x = F32(-np.inf) if miss else g[c]
            es[c] = _exp(F32(x - gmax[c]))
            total[c] = F32(total[c] + es[c])
    for lev in range(4):
        for c in range(dim):
            acc[lev, c] = F32(0.0)
    for s in range(span):
        row, miss = _window_row(state, new, row_slots, b, q_n, j + s, s1)
        off = dim if overlap and s >= ratio else 0
        kv, es, a0 = row[off:off + dim], e[s], acc[0]
        for c in range(dim):
            k = F32(0.0) if miss else kv[c]
            a0[c] = F32(a0[c] + F32(k * F32(es[c] / total[c])))
        if (s + 1) % 16 == 0:             # torch's level cascade (level step 16)
            for lev in range(1, 4):
                for c in range(dim):
                    acc[lev, c] = F32(acc[lev, c] + acc[lev - 1, c])
                    acc[lev - 1, c] = F32(0.0)
                if (s + 1) & (15 << (4 * lev)):
                    break
    for c in range(dim):
        out[c] = F32(F32(F32(acc[0, c] + acc[1, c]) + acc[2, c]) + acc[3, c])


@njit(cache=True, error_model="numpy")
def _compressor_kernel(rows, ape, positions, has_ape, state, row_slots, entry_rows, kind, cand, entry_slots,
                       w, eps, cos, sin, ratio, overlap, bf16, lanes):
    """Entries first (they read the history as it was before the step), then the state rows."""
    b_n, q_n, two_w = rows.shape
    width = two_w // 2
    dim = width // 2 if overlap else width
    span = 2 * ratio if overlap else ratio
    s1 = span - 1
    if not (_slots_in_range(row_slots.ravel(), state.shape[0])
            and (kind == 0 or _slots_in_range(entry_slots.ravel(), entry_rows.shape[0]))):
        return _BAD_SLOT
    new = np.empty((b_n * q_n, two_w), dtype=np.float32)
    _new_rows(rows, ape, positions, ratio, width, has_ape, new)
    scr = np.empty((8 + span, dim), dtype=np.float32)
    v = np.empty(dim, dtype=np.float32)
    acc = np.empty((_LEVELS, _ILP * lanes), dtype=np.float32)
    for b in range(b_n):
        for j in range(q_n):
            if entry_slots[b, j] < 0:
                continue
            _pool_entry(state, new, row_slots, b, j, q_n, s1, span, ratio, width, dim, overlap, v, scr)
            if bf16:                      # pooled.to(dtype)
                for c in range(dim):
                    v[c] = _to_bf16(v[c])
            _rms_weighted(v, w, eps, bf16, lanes, acc)
            _rope(v, cos[b, j], sin[b, j], False, bf16)
            if kind:
                _store_raw(v, entry_rows[entry_slots[b, j]], kind)
            else:
                crow = cand[b * q_n + j]
                for c in range(dim):
                    crow[c] = v[c]
    for b in range(b_n):
        for j in range(q_n):
            dst = row_slots[b, s1 + j]
            if dst >= 0:
                src, out = new[b * q_n + j], state[dst]
                for c in range(two_w):
                    out[c] = src[c]
    return _OK


def compressor_step(rows: torch.Tensor, state_pool: torch.Tensor, row_slots: torch.Tensor,
                    entry_pool: torch.Tensor, entry_fmt: str, entry_slots: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, cos: torch.Tensor, sin: torch.Tensor, ratio: int, overlap: bool,
                    dtype: torch.dtype = torch.float32, ape: torch.Tensor | None = None,
                    positions: torch.Tensor | None = None) -> None:
    """kernels/triton/compressor_step.py's op: append the step's rows to ``state_pool`` and write
    the entries they complete into ``entry_pool`` (in place)."""
    _ref.check_compressor_step(rows, state_pool, row_slots, entry_slots, norm_weight, cos, sin, ratio, overlap, dtype, ape,
               positions)
    b, t, two_w = rows.shape
    width, dim, span = _ref.compressor_geometry(rows, ratio, overlap)
    entry_rows, kind = _raw_pool(entry_pool, entry_fmt, dim)
    if b * t == 0:
        return
    if rows.dtype not in _FLOAT:                                          # fp16 projections: widen (exact)
        rows = rows.float()
    rows, row_slots, entry_slots = rows.contiguous(), _int64(row_slots), _int64(entry_slots)  # one variant each
    has_ape = ape is not None
    cand = np.empty((b * t, dim), dtype=np.float32) if kind == 0 else _NO_F32
    status = _compressor_kernel(
        _bits(rows), _f32(ape) if has_ape else _NO_F32, _int64(positions).numpy() if has_ape else _NO_I64_2D,
        has_ape, state_pool.view(-1, two_w).numpy(), row_slots.numpy(), _NO_F32 if kind == 0 else entry_rows, kind,
        cand, entry_slots.numpy(), _bits(norm_weight), eps, _f32(cos), _f32(sin), ratio, overlap,
        dtype == torch.bfloat16, _LANES)
    if status != _OK:
        raise IndexError("row_slots / entry_slots must be -1 or index their pools")
    if kind == 0:
        flat = entry_slots.reshape(-1).long()
        capacity = entry_pool.shape[0] * entry_pool.shape[1]
        if not _slots_in_range(flat.numpy(), capacity):
            _raise_bad_slot("entry_slots", capacity)
        cpu_kv.scatter_records(torch.from_numpy(cand), entry_pool, flat, get_format(entry_fmt, dim))
