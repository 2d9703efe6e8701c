"""DeepSeek-V4 attention: shared K=V latent, sink, sliding window, CSA/HCA compressors, indexer.

Projections run once over every token of the step (all sequences flattened, unpadded); the
part that reads a sequence's history (window, compressor windows, index scores, the attention
core) is the step's attention context's job (`ctx.attend`): `SequenceContext` here, for any
mix of prefill chunks and decodes, or the static-shape `DecodeBatch` (engine/decode_batch.py),
for decode/verify steps that a CUDA graph can capture. Both state the maths through
engine/v4/attention_ops.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import kernels

from ..config import ModelConfig
from ..linear import GroupedLinear, Linear
from .attention_ops import finish_entries, index_scores, pool_span, sink_attention, top_k_entries

# Queries are processed in blocks so that prefill never materialises a T×T score matrix.
QUERY_BLOCK = 256


@dataclass(slots=True)
class SeqSlice:
    """One sequence's share of a step: tokens [begin, begin+length) of the flattened batch,
    at absolute positions [start, start+length). `state` is its KV state (dense or paged),
    addressed by position."""

    state: object
    start: int
    begin: int
    length: int

    @property
    def end(self) -> int:
        return self.begin + self.length


@dataclass
class StepRope:
    """cos/sin per flattened token for the two rope flavours ('main' for SWA layers,
    'compress' for CSA/HCA layers), plus the table to rotate compressed entries."""

    main: tuple[torch.Tensor, torch.Tensor]
    compress: tuple[torch.Tensor, torch.Tensor]
    compress_table: object  # RotaryTable for entry positions


class Compressor(nn.Module):
    """Gated pooling of every `ratio` tokens into one entry (HCA) or, with `overlap`, of the
    previous window's Ca half plus the current window's Cb half (CSA)."""

    def __init__(self, hidden: int, out_dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        self.ratio, self.overlap, self.out_dim, self.eps = ratio, overlap, out_dim, eps
        width = (2 if overlap else 1) * out_dim
        self.wkv = Linear(hidden, width)
        self.wgate = Linear(hidden, width)
        self.ape = nn.Parameter(torch.empty(ratio, width))  # fp32 position bias per window slot
        self.norm = nn.Parameter(torch.empty(out_dim))

    @property
    def span(self) -> int:
        """Positions one entry pools: the previous window too when overlapping."""
        return (2 if self.overlap else 1) * self.ratio

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows [C | Z + ape] for every token: [T, 2·width], fp32."""
        c = self.wkv(x).float()
        z = self.wgate(x).float() + self.ape.float()[positions % self.ratio]
        return torch.cat((c, z), dim=-1)


class Indexer(nn.Module):
    """Lightning indexer: its own overlapping compressor of index keys plus query heads."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.num_heads, self.head_dim, self.topk, self.ratio = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, ratio
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads)
        self.compressor = Compressor(cfg.hidden_size, cfg.index_head_dim, ratio, True, cfg.rms_norm_eps)

    def queries(self, q_res: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(index queries [T, Hi, dI] fp32, head weights [T, Hi] fp32)."""
        q = self.wq_b(q_res).view(q_res.shape[0], self.num_heads, self.head_dim)
        q = kernels.norm_rope(q, 0, None, 0.0, cos, sin).float()  # RoPE only
        w = self.weights_proj(x).float() * self.num_heads**-0.5
        return q, w


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, ratio: int):
        super().__init__()
        self.cfg, self.kind, self.ratio = cfg, kind, ratio
        h, hd = cfg.num_heads, cfg.head_dim
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = nn.Parameter(torch.empty(cfg.q_lora_rank))
        self.wq_b = Linear(cfg.q_lora_rank, h * hd)
        self.wkv = Linear(cfg.hidden_size, hd)
        self.kv_norm = nn.Parameter(torch.empty(hd))
        self.wo_a = GroupedLinear(cfg.o_groups, h * hd // cfg.o_groups, cfg.o_lora_rank)  # stored [G·o_lora, H·hd/G]
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(h))
        self.compressor = Compressor(cfg.hidden_size, hd, ratio, kind == "csa", cfg.rms_norm_eps) if ratio else None
        self.indexer = Indexer(cfg, ratio) if kind == "csa" else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: StepRope, ctx, layer: int) -> torch.Tensor:
        """x: [T, D] → [T, D]. `ctx` is the step's attention context (it reads and writes the KV
        state of layer `layer`)."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        cos, sin = rope.main if self.kind == "swa" else rope.compress
        # kernels.norm_rope is layers.rms_norm / head_rms_norm then apply_rope, bit for bit, in one
        # pass (a prefill's q is [T, H, hd]: the torch composition spent ~20% of a prefill there)
        t = x.shape[0]
        q_res = kernels.norm_rope(self.wq_a(x).unsqueeze(1), 1, self.q_norm, eps).view(t, cfg.q_lora_rank)
        q = self.wq_b(q_res).view(t, cfg.num_heads, cfg.head_dim)
        q = kernels.norm_rope(q, 2, None, eps, cos, sin)  # [T, H, hd]: head RMSNorm + RoPE
        kv = kernels.norm_rope(self.wkv(x).unsqueeze(1), 1, self.kv_norm, eps, cos, sin).view(t, cfg.head_dim)
        comp_rows = self.compressor.project(x, positions) if self.compressor is not None else None
        idx_rows = self.indexer.compressor.project(x, positions) if self.indexer is not None else None
        out = ctx.attend(self, layer, q, kv, x, q_res, (cos, sin), comp_rows, idx_rows, rope.compress_table)
        out = kernels.norm_rope(out, 0, None, eps, cos, sin, inverse=True, dtype=x.dtype)  # undo V's rotation
        grouped = out.view(t, cfg.o_groups, cfg.num_heads * cfg.head_dim // cfg.o_groups)  # [T, G, H·hd/G]
        low = self.wo_a(grouped).flatten(1)  # [T, G·o_lora]
        return self.wo_b(low)


# ---- the per-sequence attention context ------------------------------------------------------


def compress_sequence(compressor: Compressor, state, rows: torch.Tensor, start: int, rope_table,
                      dtype: torch.dtype) -> int:
    """Append one sequence's new compressor rows (positions [start, start+n)) and write every
    entry they complete; return the sequence's entry count afterwards.

    state: its `rows` (position → row) and `entries` (index → record) stores. Entry w pools the
    span of positions ending at m·w + m − 1; positions before 0 are missing."""
    m, span, n = compressor.ratio, compressor.span, rows.shape[0]
    first, last = start // m, (start + n) // m  # entries [first, last) are new
    if last > first:
        lo = m * first + m - span  # first position the new spans read
        history = state.rows.read(max(lo, 0), start)
        pending = torch.cat((history, rows[: m * last - start]), dim=0)  # positions [max(lo, 0), m·last)
        if lo < 0:  # before the sequence start: zero rows that `missing` takes out
            pending = torch.cat((pending.new_zeros(-lo, pending.shape[-1]), pending), dim=0)
        spans = pending.unfold(0, span, m).transpose(-1, -2)  # [new, span, 2·width]
        pos = torch.arange(lo, m * last, device=rows.device).unfold(0, span, m)  # [new, span]
        pooled = pool_span(spans, pos < 0, compressor.overlap, m, compressor.out_dim)
        entries = finish_entries(pooled, compressor, torch.arange(first, last, device=rows.device), rope_table, dtype)
        state.entries.write(first, entries)
    state.rows.write(start, rows)
    return last


class SequenceContext:
    """Attention over the step's sequences one at a time, reading and writing each sequence's
    state by position: any mix of prefill chunks, decodes and verifications."""

    def __init__(self, seqs: list[SeqSlice]):
        self.seqs = seqs

    def attend(self, attn: Attention, layer: int, q, kv, x, q_res, rope, comp_rows, idx_rows, rope_table):
        """q: [T, H, hd]; kv: [T, hd]. Returns [T, H, hd] fp32."""
        cos, sin = rope
        idx_q = idx_w = None
        indexer = attn.indexer
        # Index queries matter only once some sequence has more entries than top-k.
        if indexer is not None and max(((s.start + s.length) // attn.ratio for s in self.seqs), default=0) > indexer.topk:
            idx_q, idx_w = indexer.queries(q_res, x, cos, sin)
        out = torch.empty(x.shape[0], attn.cfg.num_heads, attn.cfg.head_dim, dtype=torch.float32, device=x.device)
        for s in self.seqs:
            st = s.state.layer(layer)
            sl = slice(s.begin, s.end)
            entries = mask = None
            if attn.compressor is not None:
                count = compress_sequence(attn.compressor, st.compressor, comp_rows[sl], s.start, rope_table, x.dtype)
                entries = st.compressor.entries.read(count)
                pos = torch.arange(s.start, s.start + s.length, device=x.device)
                mask = torch.arange(count, device=x.device)[None, :] < ((pos + 1) // attn.ratio)[:, None]  # [n, E]
                if indexer is not None:
                    n_keys = compress_sequence(indexer.compressor, st.indexer, idx_rows[sl], s.start, rope_table,
                                               x.dtype)
                    if idx_q is not None and count > indexer.topk:
                        keys = st.indexer.entries.read(n_keys)
                        scores = index_scores(idx_q[sl][None], idx_w[sl][None], keys[None], indexer.head_dim)[0]
                        picked, valid = top_k_entries(scores, mask, indexer.topk)
                        mask = torch.zeros_like(mask).scatter_(-1, picked, valid)
            out[sl] = self._attend_one(attn, q[sl].float(), kv[sl], st, s.start, entries, mask)
        return out

    @staticmethod
    def _attend_one(attn: Attention, q: torch.Tensor, kv_new: torch.Tensor, st, start: int,
                    entries: torch.Tensor | None, entry_mask: torch.Tensor | None) -> torch.Tensor:
        """Sliding-window + compressed-entry attention for one sequence.

        q: [n, H, hd] fp32; kv_new: [n, hd]; entries: [E, hd]; entry_mask: [n, E] (True = attend).
        """
        n = q.shape[0]
        window = attn.cfg.sliding_window
        kbase = max(0, start - window + 1)
        keys = torch.cat((st.window.read(kbase, start), kv_new), dim=0).float()  # positions [kbase, start+n)
        st.window.write(start, kv_new)
        comp = entries.float() if entries is not None and entries.shape[0] else None
        scale = attn.cfg.head_dim**-0.5
        out = torch.empty_like(q)
        for a in range(0, n, QUERY_BLOCK):
            b = min(n, a + QUERY_BLOCK)
            qpos = torch.arange(start + a, start + b, device=q.device)
            lo = max(kbase, start + a - window + 1)
            kpos = torch.arange(lo, start + b, device=q.device)
            in_window = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)  # [nb, L]
            sources = [(keys[lo - kbase : start + b - kbase][None], in_window[None])]
            if comp is not None:
                sources.append((comp[None], entry_mask[a:b][None]))
            out[a:b] = sink_attention(q[a:b][None], sources, attn.attn_sink, scale)[0]
        return out
