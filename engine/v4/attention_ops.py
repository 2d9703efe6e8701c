"""The attention maths of DeepSeek-V4, stated once for every attention backend.

Backends differ only in how they gather a step's rows (per sequence with Python lengths, or in
static shapes for CUDA graphs); both call these functions on what they gathered:

  * `pool_span`        — a compressor entry from the rows of its span (softmax-gated, fp32);
  * `finish_entries`   — the entry's RMSNorm and RoPE at its first position;
  * `index_scores`     — the lightning indexer's scores of queries against index keys;
  * `top_k_entries`    — each query's top-k visible entries, ties to the lower entry index;
  * `sink_attention`   — softmax attention over a key set with a per-head sink in the
                         denominator (keys are values: one shared latent, K = V).
"""

from __future__ import annotations

import torch

from kernels.cpu_precision import bf16_operands

from .layers import apply_rope, rms_norm


def pool_span(rows: torch.Tensor, missing: torch.Tensor | None, overlap: bool, ratio: int,
              out_dim: int) -> torch.Tensor:
    """Pool the span of one entry per leading index.

    rows: [..., span, 2·width] fp32 = [C | Z + ape] of the span's positions in order; span = 2m
    when `overlap` (the previous window, then this one), else m. missing: [..., span] True for
    positions before 0 (they take no weight). Overlapping compressors pool Ca (first d features)
    of the previous window with Cb of this one. Returns [..., d] fp32.
    """
    width = rows.shape[-1] // 2
    kv, gate = rows[..., :width], rows[..., width:]
    if missing is not None:
        kv = kv.masked_fill(missing[..., None], 0.0)
        gate = gate.masked_fill(missing[..., None], float("-inf"))
    if overlap:
        m, d = ratio, out_dim
        kv = torch.cat((kv[..., :m, :d], kv[..., m:, d:]), dim=-2)  # [..., 2m, d]: Ca(w−1) ‖ Cb(w)
        gate = torch.cat((gate[..., :m, :d], gate[..., m:, d:]), dim=-2)
    return (kv * torch.softmax(gate, dim=-2)).sum(dim=-2)


def finish_entries(pooled: torch.Tensor, compressor, entry_index: torch.Tensor, rope_table,
                   dtype: torch.dtype) -> torch.Tensor:
    """pooled [N, d] fp32 → entries [N, d] in `dtype`: RMSNorm, then RoPE at position m·w of
    each entry's first token (entry_index [N] holds w)."""
    cos, sin = rope_table(entry_index * compressor.ratio)
    return apply_rope(rms_norm(pooled.to(dtype), compressor.norm, compressor.eps), cos, sin)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Σ_h w_h · ReLU(q_h · k_e) / √dI in fp32.

    q: [N, n, Hi, dI]; weights: [N, n, Hi]; keys: [N, E, dI]. Returns [N, n, E].
    """
    with bf16_operands(q.numel() * keys.shape[1]):                # N·n·Hi·dI·E
        scores = torch.einsum("bqhd,bed->bqhe", q.float(), keys.float()).relu_() * head_dim**-0.5
    return (scores * weights.float().unsqueeze(-1)).sum(dim=2)


def top_k_entries(scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's top-k visible entries by score: (indices [..., k], valid [..., k]).

    scores, visible: [..., E] with E > k. A stable descending sort breaks exact ties (ReLU zeros
    are common) by entry index, so the choice does not depend on how a step was batched or
    chunked. Slots beyond a query's visible count are invalid.
    """
    masked = scores.masked_fill(~visible, float("-inf"))
    picked = masked.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return picked, visible.gather(-1, picked)


def sink_attention(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Attention with a per-head sink over several key sets: p = e^l / (Σ e^l + e^s_h) across all
    of them, o = Σ p · k (keys are values: one shared latent).

    q: [N, n, H, D] fp32. Each source is (keys, mask) with keys [N, L, D] shared by the n
    queries and mask [N, n, L], or keys [N, n, L, D] per query and mask [N, n, L]; True =
    attend. A query with no key attends only the sink and gets 0. Returns [N, n, H, D] fp32.
    """
    logits = []
    for keys, mask in sources:
        pattern = "bqhd,bld->bqhl" if keys.dim() == 3 else "bqhd,bqld->bqhl"
        with bf16_operands(q.numel() * keys.shape[-2]):           # N·n·H·D·L
            scores = torch.einsum(pattern, q, keys)
        logits.append((scores * scale).masked_fill(~mask[:, :, None, :], float("-inf")))
    logits.append(sink.float().view(1, 1, -1, 1).expand(*q.shape[:3], 1))
    probs = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
    out, begin = None, 0
    for keys, _ in sources:
        length = keys.shape[-2]
        pattern = "bqhl,bld->bqhd" if keys.dim() == 3 else "bqhl,bqld->bqhd"
        with bf16_operands(q.numel() * length):
            part = torch.einsum(pattern, probs[..., begin : begin + length], keys)
        out = part if out is None else out + part
        begin += length
    return out
