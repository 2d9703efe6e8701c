"""The sampler's CPU kernels: the counter hash (engine/counter_rng.py), the exponential race's
argmax (engine/sampler.py) and a greedy step's argmax with its finiteness check (`greedy_rows`,
vector passes over blocks of the vocabulary), each one numba call instead of a chain of torch ops.

On the GPU the hash is ~35 small torch ops a step, launched without a host sync; on the CPU each
of them is a dispatch of a few microseconds, ~75 µs per `row_keys` call, and the uniform grid of
an exponential race runs eight passes over [R, vocab] int64 temporaries. Here the same integer
arithmetic runs as one loop: keys and uniforms equal the torch path bit for bit (int64 maths on
values below 2^32 times a multiplier below 2^31 never overflows; a uniform is (x >> 9) + ½ scaled
by 2^-23, exact in fp32), so a seed draws the same tokens whichever path hashed it. The race
takes torch's log of the uniforms (its SLEEF log is not reproduced here) and fuses the negation,
the fp32 division and the argmax, which are exact operations, so its token is torch's too.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

MASK = 0xFFFFFFFF
MUL = 0x45D9F3B
GOLDEN = 0x9E3779B9
_HALF = np.float32(0.5)
_SCALE = np.float32(1.0 / (1 << 23))


@njit(cache=True, inline="always")
def mix(x):
    """32-bit avalanche hash of an int64 value in [0, 2^32)."""
    x = (((x >> 16) ^ x) * MUL) & MASK
    x = (((x >> 16) ^ x) * MUL) & MASK
    return (x >> 16) ^ x


@njit(cache=True)
def row_keys(seeds, counters, purpose, out):
    """out[i] = the key of (seeds[i], counters[i], purpose); seeds, counters, out: [R] int64."""
    tag = (purpose * GOLDEN) & MASK
    for i in range(seeds.shape[0]):
        seed = seeds[i]
        key = mix(seed & MASK)
        key = mix(key ^ ((seed >> 32) & MASK))
        key = mix(key ^ (counters[i] & MASK))
        out[i] = mix(key ^ tag)


@njit(cache=True)
def uniform_grid(keys, out):
    """out[r, j] = the uniform (0, 1) of index j under keys[r]; keys [R] int64, out [R, W] fp32."""
    for r in range(out.shape[0]):
        key = keys[r]
        for j in range(out.shape[1]):
            x = mix(key ^ ((j * GOLDEN) & MASK))
            out[r, j] = (np.float32(x >> 9) + _HALF) * _SCALE


@njit(cache=True)
def race_argmax(probs, log_u, out):
    """out[r] = argmax_j probs[r, j] / −log_u[r, j] in fp32: torch's `(probs / E).argmax(-1)` with
    E = −log u (the first maximum; a NaN wins at its first place, as torch's argmax has it).
    probs, log_u: [R, V] fp32; out: [R] int64."""
    for r in range(probs.shape[0]):
        best, at = -np.inf, 0
        for j in range(probs.shape[1]):
            v = probs[r, j] / -log_u[r, j]
            if v != v:
                at = j
                break
            if v > best:
                best, at = v, j
        out[r] = at


PARALLEL_GREEDY_ROWS = 4     # rows from which a greedy pass spreads over the threads (a row ~8 us at V = 32k)
_BLOCK = 256                 # greedy_rows' block: a vector max over it, then one block rescanned
_EXPONENT = np.uint32(0x7F800000)


@njit(cache=True)
def _all_finite(bits) -> bool:
    """Whether no fp32 value whose bits are `bits` [V] uint32 is an infinity or a NaN (all of
    its exponent bits set): integer compares, which vectorise without fast-math."""
    bad = 0
    for j in range(bits.shape[0]):
        bad |= (bits[j] & _EXPONENT) == _EXPONENT
    return bad == 0


@njit(cache=True, inline="always")
def _max_of(row, lo, hi):
    """A value equal to max(row[lo:hi]) of finite values, hi - lo a multiple of 8: eight running
    maxima, which LLVM packs into one vector (a single running maximum stays scalar)."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = row[lo]
    for j in range(lo, hi, 8):
        m0 = row[j] if row[j] > m0 else m0
        m1 = row[j + 1] if row[j + 1] > m1 else m1
        m2 = row[j + 2] if row[j + 2] > m2 else m2
        m3 = row[j + 3] if row[j + 3] > m3 else m3
        m4 = row[j + 4] if row[j + 4] > m4 else m4
        m5 = row[j + 5] if row[j + 5] > m5 else m5
        m6 = row[j + 6] if row[j + 6] > m6 else m6
        m7 = row[j + 7] if row[j + 7] > m7 else m7
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


@njit(cache=True)
def _first_argmax(row):
    """torch's argmax of `row` [V] fp32: the first maximum, or the first NaN."""
    best, at = row[0], 0
    if best != best:
        return 0
    for j in range(1, row.shape[0]):
        v = row[j]
        if v != v:
            return j
        if v > best:
            best, at = v, j
    return at


@njit(cache=True)
def _greedy_row(row):
    """(torch's argmax of row [V] fp32, whether every value is finite): see greedy_rows."""
    if not _all_finite(row.view(np.uint32)):
        return _first_argmax(row), False
    n = row.shape[0]
    full = n - n % _BLOCK
    best, block = row[0], 0
    for lo in range(0, full, _BLOCK):
        m = _max_of(row, lo, lo + _BLOCK)
        if m > best:
            best, block = m, lo
    for j in range(full, n):               # the tail, after every full block
        if row[j] > best:
            best, block = row[j], j
    at = block
    while row[at] != best:
        at += 1
    return at, True


@njit(cache=True)
def greedy_rows(logits, rows, token, finite):
    """For each i: token[i] = argmax of logits[rows[i]] (torch's: the first maximum, or the first
    NaN) and finite[i] = whether every logit of that row is finite. logits [N, V] fp32; rows [P]
    int64; token [P] int64; finite [P] bool. A finite row (the usual one) takes two vector passes:
    its exponents, then its blocks' maxima, keeping the first block with the largest one; the
    first element of that block equal to its maximum is the first maximum of the row (-0.0 and
    0.0 compare equal in both the scalar path and this one). Other rows take the scalar pass."""
    for i in range(rows.shape[0]):
        token[i], finite[i] = _greedy_row(logits[rows[i]])


@njit(parallel=True, cache=True)
def greedy_rows_parallel(logits, rows, token, finite):
    """greedy_rows with the rows spread over numba's threads (a batch's rows: each pass reads a
    whole vocabulary)."""
    for i in prange(rows.shape[0]):
        token[i], finite[i] = _greedy_row(logits[rows[i]])
