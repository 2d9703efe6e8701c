"""A decode step's whole MoE layer on CPU in two numba calls (plus torch's SwiGLU between them).

engine/v4/fused_decode.py's MoE is eleven ops: route, permute, gather, the w13 grouped product,
SwiGLU, the w2 grouped product, the shared expert's [w1 | w3] product, its SwiGLU and w2, and
the combine. At batch 1 on the tiny V4 each op's Python (checks, views, allocations, a parallel
launch) costs more than its arithmetic: on an AMD EPYC (Zen 4, one thread) the layer took
~440 us of which ~170 us were kernels. Here the same numba kernels run with the same arguments
from inside two jitted calls:

  moe_up    top-k selection (or the hash-routed ids) and weights, counting-sort permutation,
            gathered slots, routed [gate | up] rows (w13) and the shared expert's [w1 | w3] row
            for every token, into one [T·k + T, 2I] buffer
  (torch)   one clamped SwiGLU over that buffer: the routed and the shared activations at once
            (torch's own op, so its exp rounds as before)
  moe_down  routed w2 over the first T·k rows, shared w2 over the last T, weighted combine

so the result equals the op-by-op path bit for bit (tests/kernels/test_cpu_moe_decode.py).
The router's logits and sqrt-softplus scores stay the torch / row-kernel ops they were
(kernels/cpu_routing.py shares torch's softplus for the same reason).

Only for what it was built for: fp32 activations of at most `max_tokens` rows, FP8 or FP4
routed experts and shared projections prepared once (kernels/cpu_prepared_gemm.py), one shared
expert whose width matches the routed experts'. The caller keeps the op path for the rest.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from kernels import cpu_quant_gemm as q
from kernels.cpu_moe_glue import _moe_combine
from kernels.cpu_prepared_gemm import PreparedQuantWeight
from kernels.cpu_routing import _counting_sort, _normalise, _select_topk
from kernels.reference import router_scores

BAD_TOKEN, BAD_EXPERT = -2, -3  # moe_up's error returns (a non-negative return: experts left)


# ---- kernels ----------------------------------------------------------------------------------

@njit(cache=True, error_model="numpy")
def _product(is_fp4, codes, scales, block_n, block_k, a, a_even, a_odd, out, per):
    """out [M, N] = a [M, K] @ dequant(W)^T through the fused row kernel of W's format (for FP4,
    a's even and odd columns are written to a_even / a_odd first)."""
    if is_fp4:
        _split(a, a_even, a_odd)
        q._fp4_gemv(codes, scales, block_k, a_even, a_odd, out, per)
    else:
        q._fp8_gemv(codes, scales, block_n, block_k, a, out, per)


@njit(cache=True, error_model="numpy")
def _grouped(is_fp4, codes, scales, block_n, block_k, a, a_even, a_odd, ends, max_rows, out, per):
    """The grouped product of slots a [S, K] over ends [E]; returns the experts left (heavy)."""
    if is_fp4:
        _split(a, a_even, a_odd)
        return q._fp4_grouped_gemv(codes, scales, block_k, a_even, a_odd, ends, max_rows, out, per)
    return q._fp8_grouped_gemv(codes, scales, block_n, block_k, a, ends, max_rows, out, per)


@njit(cache=True, error_model="numpy")
def _split(a, even, odd):
    """even[m, j] = a[m, 2j], odd[m, j] = a[m, 2j + 1] (what q._split_columns copies)."""
    for m in range(a.shape[0]):
        for j in range(even.shape[1]):
            even[m, j] = a[m, 2 * j]
            odd[m, j] = a[m, 2 * j + 1]


@njit(cache=True, error_model="numpy")
def _moe_up(x, scores, bias, hashed, token_ids, tid2eid, top_k, scaling, ids, weights,
            counts, offsets, order, inverse, ends, slots,
            r_fp4, r_codes, r_scales, r_bn, r_bk, r_max_rows, r_per, slots_even, slots_odd,
            has_shared, s_fp4, s_codes, s_scales, s_bn, s_bk, s_per, x_even, x_odd, h):
    """Route, permute and gather x [T, H]'s slots, then h[:T·k] = their w13 rows and h[T·k:]
    = the shared expert's [w1 | w3] rows. Returns the experts left for the tiled path, or
    BAD_TOKEN / BAD_EXPERT (nothing else done)."""
    t_count, num_experts = scores.shape
    if hashed:
        for t in range(t_count):
            tok = token_ids[t]
            if tok < 0 or tok >= tid2eid.shape[0]:
                return BAD_TOKEN
            for j in range(top_k):
                ids[t, j] = tid2eid[tok, j]
    else:
        _select_topk(scores, bias, top_k, ids)
    for t in range(t_count):
        for j in range(top_k):
            if ids[t, j] < 0 or ids[t, j] >= num_experts:
                return BAD_EXPERT
    _normalise(scores, ids, scaling, weights)
    _counting_sort(ids.reshape(-1), num_experts, counts, offsets, order, inverse)
    for e in range(num_experts):
        ends[e] = offsets[e + 1]
    for i in range(slots.shape[0]):
        src, dst = x[order[i] // top_k], slots[i]
        for c in range(dst.shape[0]):
            dst[c] = src[c]
    s = slots.shape[0]
    heavy = _grouped(r_fp4, r_codes, r_scales, r_bn, r_bk, slots, slots_even, slots_odd, ends, r_max_rows, h[:s],
                     r_per)
    if has_shared:
        _product(s_fp4, s_codes, s_scales, s_bn, s_bk, x, x_even, x_odd, h[s:], s_per)
    return heavy


@njit(cache=True, error_model="numpy")
def _moe_down(act, ends, r_fp4, r_codes, r_scales, r_bn, r_bk, r_max_rows, r_per, act_even, act_odd, y,
              has_shared, s_fp4, s_codes, s_scales, s_bn, s_bk, s_per, sh_even, sh_odd, shared,
              weights, inverse, out, acc):
    """y = act[:S]'s w2 rows (S = y's rows), shared = act[S:]'s shared w2 rows, then out [T, H]
    = the weighted combine (cpu_moe_glue). Returns the experts left for the tiled path: then
    the combine is not done (the caller finishes y first)."""
    s = y.shape[0]
    heavy = _grouped(r_fp4, r_codes, r_scales, r_bn, r_bk, act[:s], act_even, act_odd, ends, r_max_rows, y, r_per)
    if has_shared:
        _product(s_fp4, s_codes, s_scales, s_bn, s_bk, act[s:], sh_even, sh_odd, shared, s_per)
    if heavy == 0:
        _moe_combine(y, weights, inverse, shared, has_shared, out, acc)
    return heavy


# ---- torch-facing --------------------------------------------------------------------------

class DecodeMoE:
    """One MoE layer's prepared weights: routed w13 / w2 stacks, the shared expert's packed
    [w1 | w3] and its w2 (None without a shared expert)."""

    def __init__(self, w13: PreparedQuantWeight, w2: PreparedQuantWeight, shared13: PreparedQuantWeight | None,
                 shared2: PreparedQuantWeight | None, top_k: int, scaling: float, limit: float):
        self.w13, self.w2, self.shared13, self.shared2 = w13, w2, shared13, shared2
        self.top_k, self.scaling, self.limit = top_k, np.float32(scaling), limit
        self.num_experts, self.hidden = w13.codes.shape[0], w13.k
        # Shared products past their fused row limit would need the tiled path: not here.
        self.max_tokens = min(w.max_rows for w in (shared13, shared2)) if shared13 is not None else w13.max_rows

    @staticmethod
    def compatible(w13, w2, shared13, shared2) -> bool:
        """Whether these preparations (None: not a prepared CPU weight) fit one DecodeMoE."""
        if w13 is None or w2 is None or not (w13.grouped_weight and w2.grouped_weight):
            return False
        if w13.n != 2 * w2.k or w2.n != w13.k:
            return False
        if (shared13 is None) != (shared2 is None):
            return False
        return shared13 is None or (shared13.n == w13.n and shared13.k == w13.k and shared2.k == w2.k
                                    and shared2.n == w2.n and not (shared13.grouped_weight or shared2.grouped_weight))

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x goes this way: a `PreparedQuantWeight.takes` matrix of 1..max_tokens rows."""
        return self.w13.takes(x) and 0 < x.shape[0] <= self.max_tokens

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor | None,
                 token_ids: torch.Tensor | None, tid2eid: torch.Tensor | None, swiglu) -> torch.Tensor:
        """x fp32 [T, H] (`takes(x)`), router logits fp32 [T, E] → the layer's output fp32 [T, H];
        hash routing when tid2eid [V, k] is given (with token_ids [T]), else top-k of the scores
        + bias. swiglu(h [R, 2I], limit) → [R, I] is the op path's SwiGLU."""
        t, k, e = x.shape[0], self.top_k, self.num_experts
        if logits.shape != (t, e) or logits.dtype != torch.float32:
            raise ValueError(f"router logits must be fp32 [{t}, {e}], got {logits.dtype} {tuple(logits.shape)}")
        scores = router_scores(logits).contiguous()                         # [T, E]
        s, hidden = t * k, self.hidden
        has_shared, hashed = self.shared13 is not None, tid2eid is not None
        ids = np.empty((t, k), np.int32)
        weights = torch.empty(t, k)                                          # [T, k] fp32
        counts, offsets = np.zeros(e, np.int32), np.empty(e + 1, np.int32)
        order, inverse = np.empty(s, np.int32), np.empty(s, np.int32)
        ends = np.empty(e, np.int64)
        slots = np.empty((s, hidden), np.float32)                            # [T·k, H] in expert order
        h = torch.zeros(s + (t if has_shared else 0), self.w13.n)            # [T·k (+ T), 2I]
        tokens = token_ids.to(torch.int64).numpy() if hashed else np.empty(0, np.int64)
        table = tid2eid.numpy() if hashed else np.empty((0, k), np.int32)
        b = bias.numpy() if bias is not None else np.zeros(e, np.float32)
        heavy = _moe_up(x.numpy(), scores.numpy(), b, hashed, tokens, table, k, self.scaling, ids, weights.numpy(),
                        counts, offsets, order, inverse, ends, slots, *_routed_args(self.w13, s),
                        *_shared_args(self.shared13, self.w13, t), h.numpy())
        if heavy < 0:
            self._raise(heavy, ids, token_ids, tid2eid)
        if heavy:
            self.w13._heavy_experts(torch.from_numpy(slots), ends, h[:s])
        act = swiglu(h, self.limit)                                           # [T·k (+ T), I]
        y = torch.zeros(s, hidden)                                            # [T·k, H]
        shared = torch.empty(t, hidden) if has_shared else y
        out, acc = torch.empty(t, hidden), np.empty(hidden, np.float32)     # [T, H]
        heavy = _moe_down(act.numpy(), ends, *_routed_args(self.w2, s), y.numpy(),
                          *_shared_args(self.shared2, self.w2, t), shared.numpy(),
                          weights.numpy(), inverse, out.numpy(), acc)
        if heavy:
            self.w2._heavy_experts(act[:s], ends, y)
            _moe_combine(y.numpy(), weights.numpy(), inverse, shared.numpy(), has_shared, out.numpy(), acc)
        return out

    def _raise(self, code: int, ids: np.ndarray, token_ids, tid2eid) -> None:
        """The op path's errors, word for word (kernels/checks.py)."""
        if code == BAD_TOKEN:
            lo, hi = int(token_ids.min()), int(token_ids.max())
            raise ValueError(f"token_ids must be in [0, {tid2eid.shape[0]}), got [{lo}, {hi}]")
        raise ValueError(f"expert ids must be in [0, {self.num_experts}), got [{int(ids.min())}, {int(ids.max())}]")


def _activation_halves(w: PreparedQuantWeight, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Scratch for the even and odd activation columns of `rows` rows through w (FP4 only;
    empty for FP8, which reads the activations as they are)."""
    half = w.k // 2 if w.kind == "fp4" else 0
    return np.empty((rows, half), np.float32), np.empty((rows, half), np.float32)


def _routed_args(w: PreparedQuantWeight, slots: int) -> tuple:
    """A jitted call's routed arguments (fp4, codes, scales, bN, bK, max_rows, per, even, odd)
    for a grouped product of `slots` rows, split into tasks as PreparedQuantWeight.grouped does."""
    per = q._rows_per_task(w.n * min(slots, w.codes.shape[0]))
    return (w.kind == "fp4", w.codes, w.scales, w.block[0], w.block[1], w.max_rows, per,
            *_activation_halves(w, slots))


def _shared_args(w: PreparedQuantWeight | None, routed: PreparedQuantWeight, tokens: int) -> tuple:
    """A jitted call's shared arguments (has_shared, fp4, codes, scales, bN, bK, per, even, odd)
    for the shared product of `tokens` rows, split as PreparedQuantWeight.linear does. Without a
    shared expert, one routed expert's matrices stand in: unused, they only give the call the
    array types it compiles for."""
    if w is None:
        return (False, False, routed.codes[0], routed.scales[0], routed.block[0], routed.block[1], 1,
                *_activation_halves(routed, 0))
    return (True, w.kind == "fp4", w.codes, w.scales, w.block[0], w.block[1], q._rows_per_task(w.n),
            *_activation_halves(w, tokens))
