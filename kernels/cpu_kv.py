"""CPU (numba) quantize-scatter / gather-dequantize for the formats in kernels/formats.py.

Plain ``quantize``/``dequantize`` are the paged ops on a pool of one-token blocks with slots
0..N-1 (a one-token block of fp8_ds_mla is exactly its standalone record); they skip the slot
array. Rows with slot -1 are skipped on scatter and read as zeros on gather. Inputs arrive as
uint32 (fp32 bits) or uint16 (bf16 bits); gather writes float32 or uint16 bf16 bits.

Speed (see perf/bench_kernels.py) comes from loops LLVM can vectorise:
- inner loops run over 0-based slices with constant or row-length trip counts (a signed
  ``base + j`` index would keep numba's negative-index wraparound, turning loads into gathers)
  and call only the branch-free codecs of kernels/cpu_numerics.py (LLVM inlines them);
- ``error_model="numpy"``: no ZeroDivisionError check (a branch per division), IEEE results;
- fp8_ds_mla works a 64-value block at a time (amax loop, then encode loop); fp4 blocks are too
  short for that, so a chunk of rows is handled as flat arrays: per-pair amax keys reduced by
  halving, all scales in one loop, spread back to one scale per code byte by doubling
  (uint64 word loops), then one flat encode/decode loop per row;
- kernel arguments are ``borrow``-ed (no owner), so slicing them costs no atomic refcounts that
  the two threads would contend on; paged (random) slots are prefetched a few rows ahead.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import get_num_threads, njit, prange

from kernels import checks
from kernels.cpu_numerics import (ABS_MASK, E4M3_NAN_CODE, F32, I32, INF_BITS, U8, U32, U64,
                                  UE8M0_NAN_CODE, amax_key, bf16_bits, bits_f32, borrow, clamp_inf,
                                  e2m1_code, e2m1_value, e4m3_code, e4m3_value, f32_bits, fp4_input,
                                  load_bits, load_pair, pow2, prefetch, store_pair, store_value,
                                  ue8m0_exponent, ue8m0_value)
from kernels.formats import (E4M3_MIN_SUBNORMAL, FP4_INDEX_GROUP, FP4_KV_GROUP, FP8_DS_MLA_GROUP,
                             ROPE_DIM, KVFormat)

_MIN_SCALE_BITS = np.array(E4M3_MIN_SUBNORMAL, dtype=np.float32).view(np.uint32)[()]
_FP8_GROUP = FP8_DS_MLA_GROUP
_ROPE = ROPE_DIM
_KV_GROUP = FP4_KV_GROUP
_INDEX_GROUP = FP4_INDEX_GROUP
_LOW32 = np.uint64(0xFFFFFFFF)
_AHEAD = 4          # rows ahead to prefetch on paged (random-slot) access
_CHUNK_PAIRS = 2048  # fp4: element pairs encoded per chunk (whole rows; scratch fits in L1)


@njit(cache=True, inline="always", error_model="numpy")
def _offsets(slot, block_size, data_bytes, scale_bytes, split_block):
    block, pos = slot // block_size, slot % block_size
    base = block * block_size * (data_bytes + scale_bytes)
    if split_block:
        return base + pos * data_bytes, base + block_size * data_bytes + pos * scale_bytes
    data = base + pos * (data_bytes + scale_bytes)
    return data, data + data_bytes


# ---- row kernels: quantize ------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _bf16_row(xr, dst16):
    for j in range(xr.shape[0]):
        dst16[j] = bf16_bits(load_bits(xr[j]))


@njit(cache=True, error_model="numpy")
def _fp8_ds_mla_row(xr, pool, pool16, data, scales, n_groups, scale_bytes):
    for g in range(n_groups):
        src = xr[g * _FP8_GROUP:(g + 1) * _FP8_GROUP]
        dst = pool[data + g * _FP8_GROUP:data + (g + 1) * _FP8_GROUP]
        key = U32(0)
        for j in range(_FP8_GROUP):
            key = U32(max(key, amax_key(load_bits(src[j]))))
        exponent = ue8m0_exponent(key, F32(448.0))
        inv_scale = pow2(-exponent)
        for j in range(_FP8_GROUP):
            dst[j] = e4m3_code(f32_bits(F32(bits_f32(clamp_inf(load_bits(src[j]))) * inv_scale)))
        pool[scales + g] = U8(exponent + I32(127))
    for g in range(n_groups, scale_bytes):
        pool[scales + g] = U8(0)
    nope = n_groups * _FP8_GROUP
    rope = xr[nope:nope + _ROPE]
    dst16 = pool16[(data + nope) // 2:(data + nope) // 2 + _ROPE]
    for j in range(_ROPE):
        dst16[j] = bf16_bits(load_bits(rope[j]))


@njit(cache=True, error_model="numpy")
def _max_pairs(src, dst, n):
    """dst[k] = max(src[2k], src[2k+1]) for k < n (uint32), reading src as uint64 words."""
    words = src[:2 * n].view(U64)
    for k in range(n):
        w = words[k]
        dst[k] = U32(max(U32(w & _LOW32), U32(w >> U64(32))))


@njit(cache=True, error_model="numpy")
def _double(src, dst, n):
    """dst[2k] = dst[2k+1] = src[k] for k < n (uint32), writing dst as uint64 words."""
    words = dst[:2 * n].view(U64)
    for k in range(n):
        v = U64(src[k])
        words[k] = v | (v << U64(32))


@njit(cache=True, error_model="numpy")
def _spread(scale, n_groups, width, per_byte, tmp_a, tmp_b):
    """per_byte[k] = scale[k // width] (uint32; width a power of two >= 2) by repeated doubling:
    flat word loops vectorise where a per-group broadcast loop does not."""
    src, n, level = scale, n_groups, 0
    while width > 2:
        if level % 2 == 0:
            _double(src, tmp_a, n)
            src = tmp_a
        else:
            _double(src, tmp_b, n)
            src = tmp_b
        n *= 2
        width //= 2
        level += 1
    _double(src, per_byte, n)


@njit(cache=True, inline="always", error_model="numpy")
def _fp4_scales(xp, codes, scr, index_fmt, group):
    """Block scales of the rows xp (flat element pairs, see load_pair; blocks never straddle
    rows): scale codes into ``codes``, each pair's scale (fp32 bits) into scr[4]. Returns
    whether a NaN or Inf occurs (NaN blocks then get the NaN scale code).

    Block amaxes come from a flat per-pair pass reduced by halving (no short per-block reduction
    loops); all scales are computed in one loop and spread to the pairs by doubling.
    Scratch: scr uint32 [7, n].
    """
    n = xp.shape[0]
    half = group // 2
    n_groups = n // half
    pair_keys, tmp, keys = scr[0], scr[1], scr[2]
    raw = U32(0)
    for k in range(n):
        lo, hi = load_pair(xp[k])
        pair_keys[k] = U32(max(amax_key(lo), amax_key(hi)))
        raw = U32(max(raw, U32(lo & ABS_MASK), U32(hi & ABS_MASK)))
    level_in, level_out, m, width = pair_keys, tmp, n // 2, half
    while width > 2:
        _max_pairs(level_in, level_out, m)
        level_in, level_out = level_out, level_in
        m //= 2
        width //= 2
    _max_pairs(level_in, keys, m)
    scale, per_byte, tmp_a, tmp_b = scr[3], scr[4], scr[5], scr[6]
    if index_fmt:                       # ue8m0 scale 2^e: multiply by 2^-e (exact, = x / 2^e)
        for g in range(n_groups):
            exponent = ue8m0_exponent(keys[g], F32(6.0))
            scale[g] = f32_bits(pow2(-exponent))
            codes[g] = U8(exponent + I32(127))
    else:                               # e4m3 scale: x / s, an IEEE division as the rule says
        for g in range(n_groups):
            code = e4m3_code(max(f32_bits(F32(bits_f32(keys[g]) / F32(6.0))), _MIN_SCALE_BITS))
            scale[g] = f32_bits(e4m3_value(code))
            codes[g] = code
    _spread(scale, n_groups, half, per_byte, tmp_a, tmp_b)
    special = raw >= INF_BITS
    if special:                         # rare: a NaN makes its block's scale code NaN
        nan_code = UE8M0_NAN_CODE if index_fmt else E4M3_NAN_CODE
        for g in range(n_groups):
            for k in range(g * half, (g + 1) * half):
                lo, hi = load_pair(xp[k])
                if U32(lo & ABS_MASK) > INF_BITS or U32(hi & ABS_MASK) > INF_BITS:
                    codes[g] = nan_code
    return special


@njit(cache=True, inline="always", error_model="numpy")
def _fp4_encode(xp, dst, per_byte, special, index_fmt):
    """dst[k] = the two e2m1 codes of pair k; per_byte holds each pair's scale (fp32 bits)."""
    if special:                         # NaN encodes as 0, +-Inf as +-FLT_MAX
        for k in range(xp.shape[0]):
            lo, hi = load_pair(xp[k])
            dst[k] = _fp4_byte(fp4_input(lo), fp4_input(hi), bits_f32(per_byte[k]), index_fmt)
    else:
        for k in range(xp.shape[0]):
            lo, hi = load_pair(xp[k])
            dst[k] = _fp4_byte(lo, hi, bits_f32(per_byte[k]), index_fmt)


@njit(cache=True, error_model="numpy")
def _fp4_byte(lo, hi, s, index_fmt):
    if index_fmt:
        ylo, yhi = F32(bits_f32(lo) * s), F32(bits_f32(hi) * s)
    else:
        ylo, yhi = F32(bits_f32(lo) / s), F32(bits_f32(hi) / s)
    return U8(e2m1_code(f32_bits(ylo)) | U32(e2m1_code(f32_bits(yhi)) << U32(4)))


@njit(cache=True, error_model="numpy")
def _fp4_kv_scales(xp, codes, scr):
    return _fp4_scales(xp, codes, scr, False, _KV_GROUP)


@njit(cache=True, error_model="numpy")
def _fp4_index_scales(xp, codes, scr):
    return _fp4_scales(xp, codes, scr, True, _INDEX_GROUP)


@njit(cache=True, error_model="numpy")
def _fp4_kv_encode(xp, dst, per_byte, special):
    _fp4_encode(xp, dst, per_byte, special, False)


@njit(cache=True, error_model="numpy")
def _fp4_index_encode(xp, dst, per_byte, special):
    _fp4_encode(xp, dst, per_byte, special, True)


# ---- row kernels: dequantize ----------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _zero_row(outr):
    for j in range(outr.shape[0]):
        store_value(outr, j, F32(0.0))


@njit(cache=True, error_model="numpy")
def _bf16_out_row(src16, outr):
    for j in range(outr.shape[0]):
        store_value(outr, j, bits_f32(U32(U32(src16[j]) << U32(16))))


@njit(cache=True, error_model="numpy")
def _fp8_ds_mla_out_row(pool, pool16, data, scales, outr, n_groups):
    for g in range(n_groups):
        s = ue8m0_value(pool[scales + g])
        src = pool[data + g * _FP8_GROUP:data + (g + 1) * _FP8_GROUP]
        dst = outr[g * _FP8_GROUP:(g + 1) * _FP8_GROUP]
        for j in range(_FP8_GROUP):
            store_value(dst, j, F32(e4m3_value(src[j]) * s))
    nope = n_groups * _FP8_GROUP
    src16 = pool16[(data + nope) // 2:(data + nope) // 2 + _ROPE]
    dst = outr[nope:nope + _ROPE]
    for j in range(_ROPE):
        store_value(dst, j, bits_f32(U32(U32(src16[j]) << U32(16))))


@njit(cache=True, error_model="numpy")
def _fp4_spread_scales(scale, n_groups, width, scr):
    """scale[g] (fp32 bits) for n_groups blocks -> scr[1][k] for each code byte k."""
    _spread(scale, n_groups, width, scr[1], scr[2], scr[3])


@njit(cache=True, error_model="numpy")
def _fp4_decode(src, outp, per_byte):
    """outp pair k = the two e2m1 values of byte src[k] times the pair's scale (fp32 bits)."""
    for k in range(src.shape[0]):
        b = U32(src[k])
        s = bits_f32(per_byte[k])
        store_pair(outp, k, F32(e2m1_value(b) * s), F32(e2m1_value(U32(b >> U32(4))) * s))


# ---- parallel drivers -------------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _prefetch_record(pool, slots, identity, i, block_size, data_bytes, scale_bytes, split_block):
    """Prefetch the record of row i (if any): paged slots are random, so the hardware
    prefetcher cannot see them coming; sequential (identity) rows need no hint."""
    if identity or i >= slots.shape[0] or slots[i] < 0:
        return
    data, scales = _offsets(slots[i], block_size, data_bytes, scale_bytes, split_block)
    for off in range(0, data_bytes, 64):
        prefetch(pool, data + off)
    prefetch(pool, data + data_bytes - 1)
    if scale_bytes:
        prefetch(pool, scales)
        prefetch(pool, scales + scale_bytes - 1)


@njit(cache=True, inline="always", error_model="numpy")
def _slot(slots, identity, i):
    return np.int64(i) if identity else np.int64(slots[i])


@njit(parallel=True, cache=True, error_model="numpy")
def _scatter_bf16(x_arg, slots_arg, identity, pool_arg, pool16_arg):
    x, slots, pool, pool16 = borrow(x_arg), borrow(slots_arg), borrow(pool_arg), borrow(pool16_arg)
    dim = x.shape[1]
    for i in prange(x.shape[0]):
        _prefetch_record(pool, slots, identity, i + _AHEAD, 1, 2 * dim, 0, False)
        slot = _slot(slots, identity, i)
        if slot >= 0:
            _bf16_row(x[i], pool16[slot * dim:(slot + 1) * dim])


@njit(parallel=True, cache=True, error_model="numpy")
def _scatter_fp8_ds_mla(x_arg, slots_arg, identity, pool_arg, pool16_arg, block_size, n_groups, data_bytes,
                        scale_bytes):
    x, slots, pool, pool16 = borrow(x_arg), borrow(slots_arg), borrow(pool_arg), borrow(pool16_arg)
    for i in prange(x.shape[0]):
        _prefetch_record(pool, slots, identity, i + _AHEAD, block_size, data_bytes, scale_bytes, True)
        slot = _slot(slots, identity, i)
        if slot >= 0:
            data, scales = _offsets(slot, block_size, data_bytes, scale_bytes, True)
            _fp8_ds_mla_row(x[i], pool, pool16, data, scales, n_groups, scale_bytes)


@njit(cache=True, error_model="numpy")
def _copy(src, dst):
    for k in range(src.shape[0]):
        dst[k] = src[k]


@njit(cache=True, inline="always", error_model="numpy")
def _work_split(n_rows, n_pairs, n_threads):
    """(rows per chunk, chunks, workers, chunks per worker): a chunk's scratch stays in L1."""
    rows_per = max(1, _CHUNK_PAIRS // n_pairs)
    n_chunks = (n_rows + rows_per - 1) // rows_per
    workers = max(1, min(n_threads, n_chunks))
    return rows_per, n_chunks, workers, (n_chunks + workers - 1) // workers


@njit(parallel=True, cache=True, error_model="numpy")
def _scatter_fp4(xflat_arg, n_pairs, slots_arg, identity, pool_arg, block_size, index_fmt, n_threads):
    """xflat: the rows' element pairs, flat (uint32: bf16 x2, uint64: fp32 x2).

    A chunk of rows gets its block scales as one flat block (the rules are per 16/32-value
    block and blocks never straddle rows); each row is then encoded straight into its slot.
    """
    xflat, slots, pool = borrow(xflat_arg), borrow(slots_arg), borrow(pool_arg)
    n = xflat.shape[0] // n_pairs
    n_groups = 2 * n_pairs // (_INDEX_GROUP if index_fmt else _KV_GROUP)
    rows_per, n_chunks, workers, per_worker = _work_split(n, n_pairs, n_threads)
    for w in prange(workers):
        scr = np.empty((7, rows_per * n_pairs), dtype=U32)
        codes_tmp = np.empty(rows_per * n_groups, dtype=U8)
        for c in range(w * per_worker, min(n_chunks, (w + 1) * per_worker)):
            r0 = c * rows_per
            r1 = min(n, r0 + rows_per)
            for i in range(r0, r1):
                _prefetch_record(pool, slots, identity, i, block_size, n_pairs, n_groups, False)
            xc = xflat[r0 * n_pairs:r1 * n_pairs]
            cc = codes_tmp[:(r1 - r0) * n_groups]
            if index_fmt:
                special = _fp4_index_scales(xc, cc, scr)
            else:
                special = _fp4_kv_scales(xc, cc, scr)
            per_byte = scr[4]
            for i in range(r0, r1):
                slot = _slot(slots, identity, i)
                if slot < 0:
                    continue
                data, scales = _offsets(slot, block_size, n_pairs, n_groups, False)
                o, og = (i - r0) * n_pairs, (i - r0) * n_groups
                if index_fmt:
                    _fp4_index_encode(xc[o:o + n_pairs], pool[data:data + n_pairs],
                                      per_byte[o:o + n_pairs], special)
                else:
                    _fp4_kv_encode(xc[o:o + n_pairs], pool[data:data + n_pairs],
                                   per_byte[o:o + n_pairs], special)
                _copy(cc[og:og + n_groups], pool[scales:scales + n_groups])


@njit(parallel=True, cache=True, error_model="numpy")
def _gather_bf16(pool_arg, pool16_arg, slots_arg, identity, out_arg):
    pool, pool16, slots, out = borrow(pool_arg), borrow(pool16_arg), borrow(slots_arg), borrow(out_arg)
    dim = out.shape[1]
    for i in prange(out.shape[0]):
        _prefetch_record(pool, slots, identity, i + _AHEAD, 1, 2 * dim, 0, False)
        slot = _slot(slots, identity, i)
        if slot < 0:
            _zero_row(out[i])
        else:
            _bf16_out_row(pool16[slot * dim:(slot + 1) * dim], out[i])


@njit(parallel=True, cache=True, error_model="numpy")
def _gather_fp8_ds_mla(pool_arg, pool16_arg, slots_arg, identity, out_arg, block_size, n_groups, data_bytes,
                       scale_bytes):
    pool, pool16, slots, out = borrow(pool_arg), borrow(pool16_arg), borrow(slots_arg), borrow(out_arg)
    for i in prange(out.shape[0]):
        _prefetch_record(pool, slots, identity, i + _AHEAD, block_size, data_bytes, scale_bytes, True)
        slot = _slot(slots, identity, i)
        if slot < 0:
            _zero_row(out[i])
        else:
            data, scales = _offsets(slot, block_size, data_bytes, scale_bytes, True)
            _fp8_ds_mla_out_row(pool, pool16, data, scales, out[i], n_groups)


@njit(parallel=True, cache=True, error_model="numpy")
def _gather_fp4(pool_arg, slots_arg, identity, outflat_arg, n_pairs, block_size, index_fmt, n_threads):
    """outflat: the output rows as flat pairs (uint32: bf16 x2, uint64: fp32 x2).

    The scales of a chunk of rows are decoded and spread as one flat block; each row is then
    decoded straight from its slot (slot -1: zeros).
    """
    pool, slots, outflat = borrow(pool_arg), borrow(slots_arg), borrow(outflat_arg)
    n = outflat.shape[0] // n_pairs
    n_groups = 2 * n_pairs // (_INDEX_GROUP if index_fmt else _KV_GROUP)
    width = n_pairs // n_groups
    rows_per, n_chunks, workers, per_worker = _work_split(n, n_pairs, n_threads)
    for w in prange(workers):
        scr = np.empty((4, rows_per * n_pairs), dtype=U32)
        for c in range(w * per_worker, min(n_chunks, (w + 1) * per_worker)):
            r0 = c * rows_per
            r1 = min(n, r0 + rows_per)
            scale = scr[0]
            for i in range(r0, r1):
                _prefetch_record(pool, slots, identity, i, block_size, n_pairs, n_groups, False)
            for i in range(r0, r1):
                slot = _slot(slots, identity, i)
                sc = scale[(i - r0) * n_groups:(i - r0 + 1) * n_groups]
                if slot < 0:
                    sc[:] = 0
                else:
                    _, scales = _offsets(slot, block_size, n_pairs, n_groups, False)
                    _scale_bits(pool[scales:scales + n_groups], sc, index_fmt)
            _fp4_spread_scales(scale, (r1 - r0) * n_groups, width, scr)
            per_byte = scr[1]
            for i in range(r0, r1):
                slot = _slot(slots, identity, i)
                o = (i - r0) * n_pairs
                out_row = outflat[i * n_pairs:(i + 1) * n_pairs]
                if slot < 0:
                    _zero_row(out_row)
                else:
                    data, _ = _offsets(slot, block_size, n_pairs, n_groups, False)
                    _fp4_decode(pool[data:data + n_pairs], out_row, per_byte[o:o + n_pairs])


@njit(cache=True, error_model="numpy")
def _scale_bits(codes, dst, index_fmt):
    """dst[g] = fp32 bits of the scale with code codes[g] (ue8m0 or e4m3)."""
    if index_fmt:
        for g in range(codes.shape[0]):
            dst[g] = f32_bits(ue8m0_value(codes[g]))
    else:
        for g in range(codes.shape[0]):
            dst[g] = f32_bits(e4m3_value(codes[g]))


# ---- torch-facing wrappers --------------------------------------------------------------------

_NO_SLOTS = np.zeros(0, dtype=np.int64)


def _input_array(x: torch.Tensor, pairs: bool = False) -> np.ndarray:
    """Zero-copy bits of x: uint16 for bf16, uint32 for fp32 (fp16 is widened to fp32 first).

    ``pairs``: adjacent elements as one word instead (uint32 for bf16, uint64 for fp32).
    """
    x = x.contiguous() if x.dtype == torch.bfloat16 else x.contiguous().float()
    if pairs and x.data_ptr() % 8:
        x = x.clone()                   # keep word loads aligned
    bits = x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else \
        x.numpy().view(np.uint32)
    if pairs:
        return bits.view(np.uint32 if bits.dtype == np.uint16 else np.uint64)
    return bits


def _slot_array(slots: torch.Tensor | None) -> tuple[np.ndarray, bool]:
    if slots is None:
        return _NO_SLOTS, True
    return slots.contiguous().numpy(), False


def scatter_records(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor | None,
                    f: KVFormat) -> None:
    """Write quantized rows of x into the contiguous uint8 pool [blocks, B, R] (in place).

    ``slots`` None means row i goes to slot i.
    """
    fp4 = f.name in ("fp4_kv", "fp4_index")
    xs, flat, block_size = _input_array(x, pairs=fp4), pool.view(-1).numpy(), pool.shape[1]
    sl, identity = _slot_array(slots)
    if x.shape[0] == 0:
        return
    if f.name == "bf16":
        _scatter_bf16(xs, sl, identity, flat, flat.view(np.uint16))
    elif f.name == "fp8_ds_mla":
        _scatter_fp8_ds_mla(xs, sl, identity, flat, flat.view(np.uint16), block_size, f.num_scales,
                            f.data_bytes, f.scale_bytes)
    else:
        _scatter_fp4(xs.reshape(-1), f.dim // 2, sl, identity, flat, block_size, f.name == "fp4_index",
                     get_num_threads())


def gather_records(pool: torch.Tensor, slots: torch.Tensor | None, f: KVFormat,
                   out_dtype: torch.dtype, rows: int | None = None) -> torch.Tensor:
    """Dequantize slots [M] of the pool -> [M, D] in out_dtype; slot -1 gives zeros.

    ``slots`` None means slots 0..rows-1.
    """
    bf16_out = out_dtype == torch.bfloat16
    sl, identity = _slot_array(slots)
    n = rows if identity else sl.shape[0]
    out = torch.empty((n, f.dim), dtype=torch.int16 if bf16_out else torch.float32)
    if n:
        res = out.numpy().view(np.uint16) if bf16_out else out.numpy()
        flat, block_size = pool.view(-1).numpy(), pool.shape[1]
        if f.name == "bf16":
            _gather_bf16(flat, flat.view(np.uint16), sl, identity, res)
        elif f.name == "fp8_ds_mla":
            _gather_fp8_ds_mla(flat, flat.view(np.uint16), sl, identity, res, block_size,
                               f.num_scales, f.data_bytes, f.scale_bytes)
        else:
            pairs = res.view(np.uint32 if bf16_out else np.uint64)
            _gather_fp4(flat, sl, identity, pairs.reshape(-1), f.dim // 2, block_size,
                        f.name == "fp4_index", get_num_threads())
    return out.view(torch.bfloat16) if bf16_out else out.to(out_dtype)


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    f = checks.check_values(x, fmt)
    records = torch.empty((x.shape[0], 1, f.record_bytes), dtype=torch.uint8)
    scatter_records(x, records, None, f)
    return records.view(x.shape[0], f.record_bytes)


def dequantize(records: torch.Tensor, fmt: str, out_dtype: torch.dtype = torch.float32,
               dim: int | None = None) -> torch.Tensor:
    f = checks.format_for_records(records, fmt, dim)
    checks.check_records(records, f)
    checks.check_out_dtype(out_dtype)
    pool = records.contiguous().view(records.shape[0], 1, f.record_bytes)
    return gather_records(pool, None, f, out_dtype, rows=records.shape[0])


def quantize_scatter(x: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor, fmt: str) -> None:
    f = checks.check_values(x, fmt)
    checks.check_pool(pool, f)
    checks.check_slots(slot_mapping, x.shape[0], pool.shape[0] * pool.shape[1], check_range=True)
    scatter_records(x, pool, slot_mapping, f)


def gather_dequantize(pool: torch.Tensor, slots: torch.Tensor, fmt: str,
                      out_dtype: torch.dtype = torch.float32, dim: int | None = None) -> torch.Tensor:
    f = checks.format_for_records(pool, fmt, dim)
    checks.check_pool(pool, f)
    checks.check_out_dtype(out_dtype)
    checks.check_slots(slots, None, pool.shape[0] * pool.shape[1], check_range=True)
    return gather_records(pool, slots, f, out_dtype)
