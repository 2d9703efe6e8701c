"""torch's CPU elementwise maths of the decode step's MoE, reproduced in numba: SwiGLU and the
router's sqrt-softplus scores, so the whole step can run inside one jitted call
(kernels/cpu_step.py) and still compute what the op-by-op path computes.

torch evaluates an elementwise op over a contiguous buffer of n elements in chunks (aten's
`vectorized_loop`): runs of `CHUNK` elements (two SIMD vectors) through the vectorised op, whose
exp is SLEEF's `expf_u10`, then the last n % CHUNK elements through the scalar op, whose exp is
libm's `expf` (numba's np.exp calls the same libm). Past `GRAIN` elements with more than one
torch thread, at::parallel_for first splits the buffer into one piece per thread, each with its
own tail. So the value of element i depends on where it sits, and `_chunked_exp` takes the same
path for it:

- `sleef_expf` is SLEEF's algorithm (Cody-Waite reduction by ln 2 in two parts, a degree-6
  polynomial in fused multiply-adds, 2^q applied in two halves), bit for bit what torch's vector
  op returns (checked against torch's silu in tests/kernels/test_cpu_step.py);
- CHUNK is probed against torch at import: 32 where silu runs AVX-512 vectors, 16 for AVX2, 0
  (every element scalar) for a build without vector kernels. A probe that matches no pattern
  leaves `EXACT` False: results then differ from torch's by an fp32 ulp at most per exp.

The router's softplus is log1p(exp(x)) (x itself past the threshold 20): SLEEF's expf and
log1pf_u10 (`sleef_log1pf`: the reduction by the exponent of (1 + d)/0.75, then double-float
arithmetic on fused multiply-adds, as SLEEF 3.6 builds it for AVX2 / AVX-512) in the vector body,
libm's expf and log1pf in the tail, with its own probed chunk (`SOFTPLUS_CHUNK`: an op may be
built for other vectors than silu). torch's sqrt of the scores is MKL's vmsSqrt (high-accuracy
mode, which is not always the rounded root); where torch's own library exports it, the scores
take the same call (`VML_SQRT`), else IEEE sqrt (then an fp32 ulp off in ~15% of the scores).
"""
from __future__ import annotations

import ctypes
import os

import llvmlite.binding as llvm
import numpy as np
import torch
from numba import njit, types

from kernels.cpu_mhc import fma32
from kernels.cpu_numerics import F32, U32, bits_f32, f32_bits

I32 = np.int32
GRAIN = 32768                       # at::internal::GRAIN_SIZE: below it an op runs on one thread
_R_LN2 = F32(1.442695040888963407359924681001892137426645954152985934135449406931)
_L2U = F32(0.693145751953125)       # ln 2 split so q · _L2U is exact
_L2L = F32(1.428606765330187045e-06)
SOFTPLUS_THRESHOLD = F32(20.0)


@njit(cache=True, error_model="numpy")
def _pow2i(q):
    """2^q as fp32 for q in [-126, 127], from its bits."""
    return U32(U32(q + I32(0x7F)) << U32(23)).view(F32)


@njit(cache=True, error_model="numpy")
def sleef_expf(d):
    """SLEEF's expf_u10 (torch's Vectorized<float>::exp) for one fp32 value."""
    if d != d:
        return d
    if d < F32(-104.0):
        return F32(0.0)
    if F32(100.0) < d:
        return F32(np.inf)
    q = I32(np.rint(d * _R_LN2))
    qf = F32(q)
    s = fma32(qf, -_L2U, d)
    s = fma32(qf, -_L2L, s)
    u = F32(0.000198527617612853646278381)
    u = fma32(u, s, F32(0.00139304355252534151077271))
    u = fma32(u, s, F32(0.00833336077630519866943359))
    u = fma32(u, s, F32(0.0416664853692054748535156))
    u = fma32(u, s, F32(0.166666671633720397949219))
    u = fma32(u, s, F32(0.5))
    u = F32(1.0) + fma32(s * s, u, s)
    return u * _pow2i(q >> 1) * _pow2i(q - (q >> 1))


@njit(cache=True, error_model="numpy")
def _piece(i, n, threads):
    """(start, end) of the piece of [0, n) holding element i, as at::parallel_for splits it."""
    if n < GRAIN or threads <= 1:
        return 0, n
    pieces = min(threads, (n + GRAIN - 1) // GRAIN)
    size = (n + pieces - 1) // pieces
    start = i // size * size
    return start, min(n, start + size)


@njit(cache=True, error_model="numpy")
def _vector_lane(i, n, chunk, threads):
    """Whether torch computes element i of an n-element elementwise op in its vector body."""
    if chunk == 0:
        return False
    start, end = _piece(i, n, threads)
    return i - start < (end - start) // chunk * chunk


@njit(cache=True, error_model="numpy")
def _chunked_exp(x, i, n, chunk, threads):
    """exp(x) for element i of n, by the path torch takes for it."""
    if _vector_lane(i, n, chunk, threads):
        return sleef_expf(x)
    return np.exp(x)


@njit(cache=True, error_model="numpy")
def silu(x, i, n, chunk, threads):
    """F.silu of element i of a contiguous n-element buffer: x / (1 + exp(-x))."""
    return x / (F32(1.0) + _chunked_exp(-x, i, n, chunk, threads))


@njit(cache=True, error_model="numpy")
def swiglu_rows(h, limit, out, chunk, threads):
    """out [R, I] = silu(min(gate, limit)) · clamp(up, -limit, limit) for h [R, 2I] = [gate | up]
    (engine.v4.layers.clamped_swiglu: the clamped gate is a new contiguous [R, I] buffer, so
    element (r, i) is number r·I + i of its silu). NaN passes through both clamps."""
    rows, width = out.shape
    n = rows * width
    lim = F32(limit)
    for r in range(rows):
        for i in range(width):
            g = h[r, i]
            g = lim if g > lim else g
            u = h[r, width + i]
            u = lim if u > lim else (-lim if u < -lim else u)
            out[r, i] = silu(g, r * width + i, n, chunk, threads) * u


_LN2_HI, _LN2_LO = F32(0.69314718246459960938), F32(-1.904654323148236017e-09)


@njit(cache=True, error_model="numpy")
def _fms(x, y, z):
    """x·y − z rounded once."""
    return fma32(x, y, -z)


@njit(cache=True, error_model="numpy")
def sleef_log1pf(d):
    """SLEEF's log1pf_u10 (torch's Vectorized<float>::log1p) for one fp32 value d >= -1."""
    if d != d or d < F32(-1.0):
        return F32(np.nan)
    if d == F32(-1.0):
        return F32(-np.inf)
    if d > F32(1e38):
        return F32(np.inf)
    if d == F32(0.0):
        return d                                              # keeps the sign of zero
    dp1 = d + F32(1.0)
    tiny = dp1 < F32(1.1754943508222875e-38)                 # subnormal: scaled up by 2^64 first
    if tiny:
        dp1 = dp1 * F32(1.8446744073709552e19)
    e = np.int64((f32_bits(F32(dp1 * F32(1.0 / 0.75))) >> U32(23)) & U32(0xFF)) - 127
    t = bits_f32(U32((np.int64(0x3F800000) - (e << 23)) & np.int64(0xFFFFFFFF)))   # 2^-e
    if tiny:
        e -= 64
    m = fma32(d, t, t - F32(1.0))
    ef = F32(e)
    sx = _LN2_HI * ef                                         # s = (ln 2 as a pair) · e
    sy = fma32(_LN2_LO, ef, _fms(_LN2_HI, ef, sx))
    dx = F32(2.0) + m                                         # (2 + m) as a pair
    dy = (F32(2.0) - dx) + m
    rec = F32(1.0) / dx                                       # x = m / (2 + m), a pair
    xx = m * rec
    u = _fms(rec, m, xx)
    v = fma32(-dy, rec, fma32(-dx, rec, F32(1.0)))
    xy = fma32(xx, v, fma32(F32(0.0), rec, u))
    x2 = xx * xx
    p = fma32(fma32(F32(0.3027294874), x2, F32(0.3996108174)), x2, F32(0.6666694880))
    s2x = sx + F32(2.0) * xx                                  # s += 2x
    sy = (((sx - s2x) + F32(2.0) * xx) + sy) + F32(2.0) * xy
    w = x2 * xx * p                                           # s += x³·p
    s3x = s2x + w
    sy = ((s2x - s3x) + w) + sy
    return s3x + sy


@njit(cache=True, error_model="numpy")
def softplus(x, i, n, chunk, threads):
    """F.softplus (beta 1, threshold 20) of element i of a contiguous n-element buffer."""
    if x > SOFTPLUS_THRESHOLD:
        return x
    if _vector_lane(i, n, chunk, threads):
        return sleef_log1pf(sleef_expf(x))
    return F32(np.log1p(np.exp(x)))


def _torch_exports(symbol: str) -> bool:
    """Whether torch's CPU library exports `symbol`; if so the JIT's linker can now resolve it."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        getattr(ctypes.CDLL(path), symbol)
    except (OSError, AttributeError):
        return False
    llvm.load_library_permanently(path)
    return True


VML_SQRT = _torch_exports("vmsSqrt")
_VML_HA_MODE = np.int64(0x140102)            # VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE, as aten's vml.h
# void vmsSqrt(MKL_INT n, const float *a, float *r, MKL_INT64 mode), LP64: the pointers as addresses
_vms_sqrt = types.ExternalFunction("vmsSqrt", types.void(types.int32, types.intp, types.intp, types.int64))


@njit(cache=True, error_model="numpy")
def _softplus_rows(logits, out, chunk, threads):
    width = logits.shape[1]
    n = logits.shape[0] * width
    for t in range(logits.shape[0]):
        for e in range(width):
            out[t, e] = softplus(logits[t, e], t * width + e, n, chunk, threads)


@njit(cache=True, error_model="numpy")
def _scores_vml(logits, out, chunk, threads):
    sp = np.empty(logits.shape, np.float32)
    _softplus_rows(logits, sp, chunk, threads)
    _vms_sqrt(np.int32(sp.size), sp.ctypes.data, out.ctypes.data, _VML_HA_MODE)


@njit(cache=True, error_model="numpy")
def _scores_ieee(logits, out, chunk, threads):
    _softplus_rows(logits, out, chunk, threads)
    for t in range(out.shape[0]):
        for e in range(out.shape[1]):
            out[t, e] = np.sqrt(out[t, e])


# out [T, E] = sqrt(softplus(logits)) of contiguous fp32 logits [T, E] (kernels.reference.router_scores);
# chunk: SOFTPLUS_CHUNK, threads: torch's
router_scores = _scores_vml if VML_SQRT else _scores_ieee


# ---- probes ----------------------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _silu_all(x, out, chunk):
    for i in range(x.shape[0]):
        out[i] = silu(x[i], i, x.shape[0], chunk, 1)


@njit(cache=True, error_model="numpy")
def _softplus_all(x, out, chunk):
    for i in range(x.shape[0]):
        out[i] = softplus(x[i], i, x.shape[0], chunk, 1)


def _probe(ours, theirs, scale: float) -> tuple[int, bool]:
    """(chunk, exact): the vector body width with which ours(x, out, chunk) reproduces torch's
    op `theirs` on one thread, on a probe whose vector and scalar results differ."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g) * scale).numpy()
    vector, scalar = np.empty_like(x), np.empty_like(x)
    ours(x, vector, 4096)
    ours(x, scalar, 0)
    differ = x[vector.view(np.int32) != scalar.view(np.int32)]
    if differ.size == 0:
        return 32, False
    probe = np.full(127, differ[0], np.float32)
    probe[::2] = x[:64]
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = theirs(torch.from_numpy(probe)).numpy()
    finally:
        torch.set_num_threads(saved)
    got = np.empty_like(probe)
    for chunk in (32, 16, 8, 64, 0):
        ours(probe, got, chunk)
        if np.array_equal(got.view(np.int32), want.view(np.int32)):
            return chunk, True
    return 32, False


CHUNK, EXACT = _probe(_silu_all, torch.nn.functional.silu, 6.0)
SOFTPLUS_CHUNK, SOFTPLUS_EXACT = _probe(_softplus_all, torch.nn.functional.softplus, 8.0)
