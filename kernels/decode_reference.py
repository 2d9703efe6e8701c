"""Torch references of the fused decode ops (kernels/triton/*.py and kernels/cpu_*.py implement
them; tests check every implementation against these), with the argument checks they share.

Plain torch, no Triton: the CPU decode path falls back to (and its tests import) these on
machines without Triton. Each Triton module re-exports its op's reference under the old name.
"""
from __future__ import annotations

import torch

from kernels import reference
from kernels.model_math import (apply_rope, clamped_swiglu, hc_collapse, hc_expand, hc_mix_weights, head_rms_norm,
                                rms_norm)
from kernels.pool_layout import RAW_DTYPES

# Compute dtypes the decode ops accept (the engine's activations).
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)


# ---- norm_rope -------------------------------------------------------------------------------

def check_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, norm: int, cos: torch.Tensor | None,
                    sin: torch.Tensor | None, slots: torch.Tensor | None) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, H, D] with unit stride along D, got {tuple(x.shape)} {x.stride()}")
    if norm not in (0, 1, 2) or (norm == 1) != (weight is not None):
        raise ValueError("norm is 0 (none), 1 (weighted rms_norm: give weight) or 2 (head_rms_norm)")
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if (cos is None) != (sin is None) or (cos is not None and (cos.shape != sin.shape or cos.shape[0] != x.shape[0])):
        raise ValueError("cos and sin must both be [T, rope/2] or both None")
    if slots is not None and slots.shape != (x.shape[0],):
        raise ValueError(f"slots must be [{x.shape[0]}], got {tuple(slots.shape)}")


def norm_rope_reference(x: torch.Tensor, norm: int = 0, weight: torch.Tensor | None = None, eps: float = 1e-6,
                        cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, inverse: bool = False,
                        dtype: torch.dtype | None = None, pre_round: bool = False, pool: torch.Tensor | None = None,
                        pool_fmt: str = "fp32", slots: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.model_math's rms_norm / head_rms_norm / apply_rope (V4's), then a reference record write."""
    check_norm_rope(x, weight, norm, cos, sin, slots)
    dtype = x.dtype if dtype is None else dtype
    y = x.to(dtype) if pre_round or x.dtype != dtype else x
    if norm == 1:
        y = rms_norm(y, weight, eps)
    elif norm == 2:
        y = head_rms_norm(y, eps)
    if cos is not None:
        y = apply_rope(y, cos.float(), sin.float(), inverse=inverse)
    if pool is not None:
        write_records(pool, pool_fmt, slots.long(), y.reshape(x.shape[0], -1)[:, : x.shape[-1]])
    return y.contiguous()


# ---- mhc_mix ---------------------------------------------------------------------------------

def check_mhc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> None:
    if streams.dim() != 3:
        raise ValueError(f"streams must be [T, n, D], got {tuple(streams.shape)}")
    _, n, d = streams.shape
    if fn.shape != ((2 + n) * n, n * d) or base.shape != ((2 + n) * n,) or scale.shape != (3,):
        raise ValueError(f"fn must be [{(2 + n) * n}, {n * d}], base [{(2 + n) * n}], scale [3]; got "
                         f"{tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}")


def mhc_mix_reference(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                      sinkhorn_iters: int, hc_eps: float, norm_eps: float, collapse: bool = False,
                      precision: str = "ieee", norm_weight: torch.Tensor | None = None,
                      out_eps: float = 1e-6) -> tuple[torch.Tensor, ...]:
    """kernels.model_math.hc_mix_weights (+ hc_collapse, + rms_norm), unchanged."""
    pre, post, comb = hc_mix_weights(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    if not collapse:
        return pre, post, comb
    x = hc_collapse(streams, pre)
    return pre, post, comb, (x if norm_weight is None else rms_norm(x, norm_weight, out_eps))


# ---- mhc_expand ------------------------------------------------------------------------------

def mhc_expand_reference(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return hc_expand(streams, y, post, comb)


# ---- sparse_mla_decode -----------------------------------------------------------------------

def check_sparse_mla_decode(q: torch.Tensor, sink: torch.Tensor, window_slots: torch.Tensor, entry_slots: torch.Tensor | None,
                            new_kv: torch.Tensor | None) -> None:
    b, t, h, _ = q.shape
    if sink.shape != (h,):
        raise ValueError(f"sink must be [{h}], got {tuple(sink.shape)}")
    for name, slots in (("window_slots", window_slots), ("entry_slots", entry_slots)):
        if slots is not None and (slots.dim() != 3 or slots.shape[:2] != (b, t) or slots.dtype.is_floating_point):
            raise ValueError(f"{name} must be int [{b}, {t}, N], got {slots.dtype} {tuple(slots.shape)}")
    if new_kv is not None and new_kv.shape != (b, t, q.shape[-1]):
        raise ValueError(f"new_kv must be [{b}, {t}, {q.shape[-1]}], got {tuple(new_kv.shape)}")


def read_records(pool: torch.Tensor, fmt: str, slots: torch.Tensor, dim: int) -> torch.Tensor:
    """Gather + dequantize slots [...] (-1 -> zero row) -> fp32 [..., dim] via kernels.reference."""
    flat = slots.reshape(-1).long()
    if fmt in RAW_DTYPES:
        rows = pool.reshape(-1, dim)[flat.clamp(min=0)].float()
        rows = torch.where((flat >= 0)[:, None], rows, 0.0)
    else:
        rows = reference.gather_dequantize(pool, flat, fmt, torch.float32, dim)
    return rows.view(*slots.shape, dim)


def sparse_mla_decode_reference(q: torch.Tensor, sink: torch.Tensor, window_pool: torch.Tensor, window_fmt: str,
                                window_slots: torch.Tensor, entry_pool: torch.Tensor | None = None,
                                entry_fmt: str = "fp32", entry_slots: torch.Tensor | None = None,
                                new_kv: torch.Tensor | None = None, scale: float | None = None,
                                precision: str = "ieee", block_n: int = 16, window_shared: bool = False,
                                entries_shared: bool = False) -> torch.Tensor:
    """Plain gather, dequantize and softmax over [window | entries | new | sink], row by row (the
    sharing flags only say how the kernel may read: the answer is the same)."""
    check_sparse_mla_decode(q, sink, window_slots, entry_slots, new_kv)
    b, t, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qf = q.float()
    keys = [read_records(window_pool, window_fmt, window_slots, d)]                 # [B, q, W, D]
    valid = [window_slots >= 0]
    if entry_pool is not None and entry_slots is not None:
        keys.append(read_records(entry_pool, entry_fmt, entry_slots, d))            # [B, q, K, D]
        valid.append(entry_slots >= 0)
    if new_kv is not None:
        keys.append(new_kv.float()[:, None].expand(b, t, t, d))                     # [B, q, q, D]
        valid.append(torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t))
    keys, valid = torch.cat(keys, dim=2), torch.cat(valid, dim=2)                  # [B, q, L, D], [B, q, L]
    logits = torch.einsum("bqhd,bqld->bqhl", qf, keys) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    sinks = sink.float().view(1, 1, h, 1).expand(b, t, h, 1)
    probs = torch.softmax(torch.cat((logits, sinks), dim=-1), dim=-1)[..., :-1]    # the sink takes no value
    return torch.einsum("bqhl,bqld->bqhd", probs, keys)


# ---- compressor_step -------------------------------------------------------------------------

def compressor_geometry(rows: torch.Tensor, ratio: int, overlap: bool) -> tuple[int, int, int]:
    """(width, dim, span) of a compressor from its rows."""
    width = rows.shape[-1] // 2
    dim = width // (2 if overlap else 1)
    return width, dim, (2 if overlap else 1) * ratio


def check_compressor_step(rows, state_pool, row_slots, entry_slots, norm_weight, cos, sin, ratio, overlap, dtype, ape=None,
                          positions=None) -> None:
    if rows.dim() != 3 or not rows.dtype.is_floating_point or rows.stride(-1) != 1:
        raise ValueError(f"rows must be float [B, q, 2·width] with unit column stride, got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    if rows.dtype != torch.float32 and ape is None:
        raise ValueError("rows in the compute dtype come raw from the projection: give ape and positions")
    if (ape is None) != (positions is None):
        raise ValueError("ape and positions go together")
    if ape is not None and (ape.shape != (ratio, rows.shape[-1] // 2) or positions.shape != rows.shape[:2]):
        raise ValueError(f"ape must be [{ratio}, {rows.shape[-1] // 2}] and positions [B, q]")
    b, t, two_w = rows.shape
    width, dim, span = compressor_geometry(rows, ratio, overlap)
    if state_pool.dtype != torch.float32 or state_pool.dim() != 3 or state_pool.shape[2] != two_w:
        raise ValueError(f"state_pool must be fp32 [blocks, R, {two_w}], got {state_pool.dtype} "
                         f"{tuple(state_pool.shape)}")
    if row_slots.shape != (b, span - 1 + t) or entry_slots.shape != (b, t):
        raise ValueError(f"row_slots must be [{b}, {span - 1 + t}] and entry_slots [{b}, {t}], got "
                         f"{tuple(row_slots.shape)}, {tuple(entry_slots.shape)}")
    if norm_weight.shape != (dim,) or cos.shape[:2] != (b, t) or cos.shape != sin.shape:
        raise ValueError(f"norm_weight must be [{dim}], cos/sin [{b}, {t}, rope/2]")
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be fp32 or bf16, got {dtype}")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.model_math.rms_norm: fp32 statistics and product, result in x.dtype."""
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kernels.model_math.apply_rope on [N, D]: interleaved pairs of the last 2·half channels, in fp32."""
    half = cos.shape[-1]
    pairs = x[:, -2 * half:].float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[:, :-2 * half], rotated), dim=-1)


def write_records(pool: torch.Tensor, fmt: str, slots: torch.Tensor, values: torch.Tensor) -> None:
    keep = slots >= 0
    if fmt in RAW_DTYPES:
        pool.view(-1, pool.shape[-1])[slots[keep]] = values[keep].to(pool.dtype)
    else:
        reference.quantize_scatter(values[keep].float(), pool, slots[keep], fmt)


def compressor_step_reference(rows: torch.Tensor, state_pool: torch.Tensor, row_slots: torch.Tensor,
                              entry_pool: torch.Tensor, entry_fmt: str, entry_slots: torch.Tensor,
                              norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, ratio: int,
                              overlap: bool, dtype: torch.dtype = torch.float32, ape: torch.Tensor | None = None,
                              positions: torch.Tensor | None = None) -> None:
    """The engine's torch maths (attention_decode.compress), over explicit slot tables."""
    check_compressor_step(rows, state_pool, row_slots, entry_slots, norm_weight, cos, sin, ratio, overlap, dtype, ape, positions)
    if ape is not None:  # Compressor.project: [C | Z + ape[p % m]] in fp32
        w = rows.shape[-1] // 2
        rows = torch.cat((rows[..., :w].float(), rows[..., w:].float() + ape.float()[positions.long() % ratio]), -1)
    b, t, two_w = rows.shape
    width, dim, span = compressor_geometry(rows, ratio, overlap)
    hist_slots = row_slots[:, : span - 1].long()
    history = read_records(state_pool, "fp32", hist_slots, two_w)                       # [B, span−1, 2·width]
    all_rows = torch.cat((history, rows), dim=1)                                         # [B, span−1+q, 2·width]
    missing = torch.cat((hist_slots < 0, torch.zeros(b, t, dtype=torch.bool)), dim=1)
    windows = all_rows.unfold(1, span, 1).transpose(-1, -2)                              # [B, q, span, 2·width]
    miss = missing.unfold(1, span, 1)[..., None]                                         # [B, q, span, 1]
    kv = windows[..., :width].masked_fill(miss, 0.0)
    gate = windows[..., width:].masked_fill(miss, float("-inf"))
    if overlap:
        kv = torch.cat((kv[..., :ratio, :dim], kv[..., ratio:, dim:]), dim=-2)
        gate = torch.cat((gate[..., :ratio, :dim], gate[..., ratio:, dim:]), dim=-2)
    pooled = (kv * torch.softmax(gate, dim=-2)).sum(dim=-2)                             # [B, q, d]
    normed = _rms_norm(pooled.flatten(0, 1).to(dtype), norm_weight, eps)
    candidates = _rope(normed, cos.flatten(0, 1).float(), sin.flatten(0, 1).float())    # [B·q, d]
    write_records(entry_pool, entry_fmt, entry_slots.reshape(-1).long(), candidates)
    write_records(state_pool, "fp32", row_slots[:, span - 1:].reshape(-1).long(), rows.reshape(b * t, two_w))


# ---- indexer_topk ----------------------------------------------------------------------------

def check_indexer_topk(q: torch.Tensor, weights: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                       positions: torch.Tensor, ratio: int, topk: int) -> None:
    b, t, hi, _ = q.shape
    if weights.shape != (b, t, hi) or weights.stride(-1) != 1:
        raise ValueError(f"weights must be [{b}, {t}, {hi}], got {tuple(weights.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be [{b}, F], got {tuple(block_table.shape)}")
    if lengths.shape != (b,) or positions.shape != (b, t):
        raise ValueError(f"lengths must be [{b}] and positions [{b}, {t}], got {tuple(lengths.shape)}, "
                         f"{tuple(positions.shape)}")
    if ratio < 1 or topk < 1:
        raise ValueError(f"ratio and topk must be positive, got {ratio}, {topk}")


def indexer_topk_reference(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt: str,
                           block_table: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor, ratio: int,
                           topk: int, max_entries: int | None = None, precision: str = "ieee", chunk: int = 1024,
                           weight_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch scores over every addressable entry, masked, then a stable descending sort."""
    check_indexer_topk(q, weights, block_table, lengths, positions, ratio, topk)
    weights = weights.float() * weight_scale
    b, t, hi, di = q.shape
    per_block = pool.shape[1]
    e_max = block_table.shape[1] * per_block if max_entries is None else max_entries
    e = torch.arange(e_max)
    entry_slots = block_table.long()[:, e // per_block] * per_block + e % per_block      # [B, E]
    keys = read_records(pool, fmt, entry_slots, di)                                     # [B, E, dI]
    s = torch.einsum("bqhd,bed->bqhe", q.float(), keys).relu() * di**-0.5
    scores = (s * weights.float()[..., None]).sum(dim=2)                                # [B, q, E]
    limit = torch.minimum(lengths.long()[:, None], (positions.long() + 1).clamp(min=0) // ratio)  # [B, q]
    visible = e[None, None, :] < limit[..., None]
    scores = torch.where(torch.isnan(scores) | ~visible, float("-inf"), scores)
    # Invisible entries all sit above `limit`, so the stable sort ranks visible -inf ones first.
    order = scores.sort(dim=-1, descending=True, stable=True).indices[..., :topk]       # [B, q, ≤k]
    picked = torch.where(order < limit[..., None], order, -1)
    picked = torch.nn.functional.pad(picked, (0, topk - picked.shape[-1]), value=-1)
    slot = torch.where(picked >= 0, entry_slots.gather(1, picked.clamp(min=0).flatten(1)).view_as(picked), -1)
    return picked.int(), slot.int()


# ---- moe_ops ---------------------------------------------------------------------------------

def gather_rows_reference(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    return x[order.long() // k]


def swiglu_reference(h: torch.Tensor, limit: float, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    i = h.shape[1] // 2
    act = clamped_swiglu(h[:, :i], h[:, i:], limit)
    return act if row_weight is None else act * row_weight.to(act.dtype)[:, None]


def check_moe_combine(y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor) -> None:
    t, k = weights.shape
    if inverse.shape != (t * k,) or y.shape[0] != t * k:
        raise ValueError(f"inverse must be [{t * k}] and y [{t * k}, H], got {tuple(inverse.shape)}, {tuple(y.shape)}")


def moe_combine_reference(y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor,
                          shared: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """engine/v4/moe.py's weighting, unpermute and sum, then the shared expert's add."""
    t, k = weights.shape
    rows = y[inverse.long()] * weights.reshape(-1).to(y.dtype)[:, None]
    out = rows.view(t, k, y.shape[1]).sum(dim=1).to(dtype)
    return out if shared is None else out + shared
