"""The sampler's CPU kernels: the counter hash (engine/counter_rng.py) and the exponential race's
argmax (engine/sampler.py), each one numba call instead of a chain of torch ops.

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

import math

import numpy as np
from numba import njit

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


@njit(cache=True)
def greedy_rows(logits, rows, token, finite):
    """For each i: token[i] = argmax of logits[rows[i]] (torch's: the first maximum, or the first
    NaN) and finite[i] = whether every logit of that row is finite, in one pass over the row.
    logits [N, V] fp32; rows [P] int64; token [P] int64; finite [P] bool."""
    for i in range(rows.shape[0]):
        row = logits[rows[i]]
        best, at = row[0], 0
        nan = best != best
        ok = math.isfinite(best)
        for j in range(1, row.shape[0]):
            v = row[j]
            if not math.isfinite(v):
                ok = False
            if not nan:
                if v != v:
                    at, nan = j, True
                elif v > best:
                    best, at = v, j
        token[i], finite[i] = at, ok
