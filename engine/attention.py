"""DeepSeek-V4 attention: shared K=V latent, sink, sliding window, CSA/HCA compressors, indexer.

Projections run once over every token of the step (all sequences flattened, unpadded); the
parts that read a sequence's history (window, compressor windows, index scores, the attention
core) run per sequence on `SeqSlice`s, reading and writing its `SequenceState` by position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import attention_decode
from .config import ModelConfig
from .decode_batch import DecodeBatch
from .layers import apply_rope, head_rms_norm, rms_norm
from .seq_state import CompressorState, LayerState, SequenceState

# Queries are processed in blocks so that prefill never materialises a T×T score matrix.
QUERY_BLOCK = 256


@dataclass(slots=True)
class SeqSlice:
    """One sequence's share of a step: tokens [begin, begin+length) of the flattened batch,
    at absolute positions [start, start+length)."""

    state: SequenceState
    start: int
    begin: int
    length: int

    @property
    def end(self) -> int:
        return self.begin + self.length


@dataclass
class StepRope:
    """cos/sin per flattened token for the two rope flavours ('main' for SWA layers,
    'compress' for CSA/HCA layers), plus the tables to rotate compressed entries."""

    main: tuple[torch.Tensor, torch.Tensor]
    compress: tuple[torch.Tensor, torch.Tensor]
    compress_table: object  # RotaryTable for entry positions


def _linear(in_features: int, out_features: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(out_features, in_features))


class Compressor(nn.Module):
    """Gated pooling of every `ratio` tokens into one entry (HCA) or, with `overlap`, of the
    previous window's Ca half plus the current window's Cb half (CSA)."""

    def __init__(self, hidden: int, out_dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        self.ratio, self.overlap, self.out_dim, self.eps = ratio, overlap, out_dim, eps
        width = (2 if overlap else 1) * out_dim
        self.wkv = _linear(hidden, width)
        self.wgate = _linear(hidden, width)
        self.ape = nn.Parameter(torch.empty(ratio, width))  # fp32 position bias per window slot
        self.norm = nn.Parameter(torch.empty(out_dim))

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows [C | Z + ape] for every token: [T, 2·width], fp32."""
        c = F.linear(x, self.wkv).float()
        z = F.linear(x, self.wgate).float() + self.ape.float()[positions % self.ratio]
        return torch.cat((c, z), dim=-1)

    def step(self, state: CompressorState, rows: torch.Tensor, start: int, rope_table, dtype: torch.dtype) -> int:
        """Append this step's rows, emit every window they complete; return the entry count."""
        m = self.ratio
        n = rows.shape[0]
        first, last = start // m, (start + n) // m  # entries [first, last) are new
        if last > first:
            lo = m * (first - 1) if self.overlap and first > 0 else m * first
            history = state.rows.read(lo, start)
            pending = torch.cat((history, rows[: m * last - start]), dim=0)  # positions [lo, m·last)
            entries = self._pool(pending.view(-1, m, pending.shape[-1]), first)
            cos, sin = rope_table(torch.arange(first, last, device=rows.device) * m)
            entries = apply_rope(rms_norm(entries.to(dtype), self.norm, self.eps), cos, sin)
            state.entries.write(first, entries)
        state.rows.write(start, rows)
        return last

    def _pool(self, windows: torch.Tensor, first: int) -> torch.Tensor:
        """windows: [num_windows(+1 if overlapping and first > 0), m, 2·width] → [new, out_dim]."""
        d = self.out_dim
        width = windows.shape[-1] // 2
        kv, gate = windows[..., :width], windows[..., width:]
        if self.overlap:
            if first == 0:  # window −1 does not exist: its Ca slots get zero kv and −inf gate
                kv = torch.cat((torch.zeros_like(kv[:1]), kv), dim=0)
                gate = torch.cat((torch.full_like(gate[:1], float("-inf")), gate), dim=0)
            kv = torch.cat((kv[:-1, :, :d], kv[1:, :, d:]), dim=1)  # [new, 2m, d]: Ca(w−1) ‖ Cb(w)
            gate = torch.cat((gate[:-1, :, :d], gate[1:, :, d:]), dim=1)
        weights = torch.softmax(gate, dim=1)
        return (kv * weights).sum(dim=1)


class Indexer(nn.Module):
    """Lightning indexer: its own overlapping compressor of index keys plus query heads."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.num_heads, self.head_dim, self.topk, self.ratio = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, ratio
        self.wq_b = _linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = _linear(cfg.hidden_size, cfg.index_n_heads)
        self.compressor = Compressor(cfg.hidden_size, cfg.index_head_dim, ratio, True, cfg.rms_norm_eps)

    def queries(self, q_res: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q = F.linear(q_res, self.wq_b).view(q_res.shape[0], self.num_heads, self.head_dim)
        q = apply_rope(q, cos, sin).float()  # [T, Hi, dI]
        w = F.linear(x, self.weights_proj).float() * self.num_heads**-0.5  # [T, Hi]
        return q, w

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Index scores [n, E] = Σ_h w_h · ReLU(q_h · k_e) / √dI (fp32)."""
        scores = torch.einsum("nhd,ed->nhe", q, keys.float()).relu_() * self.head_dim**-0.5
        return (scores * w.unsqueeze(-1)).sum(dim=1)

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Mask [n, E] of the entries each query attends: its top-k visible entries by index
        score (all visible ones when there are ≤ k); ties go to the lower entry index."""
        if int(visible.sum(-1).max()) <= self.topk:
            return visible
        scores = self.scores(q, w, keys).masked_fill_(~visible, float("-inf"))  # [n, E]
        # A stable sort breaks exact ties (ReLU zeros are common) by entry index, so the choice
        # does not depend on how the step was batched or chunked.
        picked = scores.sort(dim=-1, descending=True, stable=True).indices[:, : self.topk]
        mask = torch.zeros_like(visible).scatter_(-1, picked, True)
        return mask & visible


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, ratio: int):
        super().__init__()
        self.cfg, self.kind, self.ratio = cfg, kind, ratio
        h, hd = cfg.num_heads, cfg.head_dim
        self.wq_a = _linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = nn.Parameter(torch.empty(cfg.q_lora_rank))
        self.wq_b = _linear(cfg.q_lora_rank, h * hd)
        self.wkv = _linear(cfg.hidden_size, hd)
        self.kv_norm = nn.Parameter(torch.empty(hd))
        self.wo_a = _linear(h * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = _linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(h))
        self.compressor = Compressor(cfg.hidden_size, hd, ratio, kind == "csa", cfg.rms_norm_eps) if ratio else None
        self.indexer = Indexer(cfg, ratio) if kind == "csa" else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: StepRope, ctx: list[SeqSlice] | DecodeBatch,
                layer: int) -> torch.Tensor:
        """x: [T, D] → [T, D]. `ctx` is either the step's sequences (any mix of prefill chunks
        and decodes) or a static-shape `DecodeBatch` (decode/verify; CUDA-graph capturable)."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        cos, sin = rope.main if self.kind == "swa" else rope.compress
        q_res = rms_norm(F.linear(x, self.wq_a), self.q_norm, eps)  # [T, q_lora]
        q = F.linear(q_res, self.wq_b).view(x.shape[0], cfg.num_heads, cfg.head_dim)
        q = apply_rope(head_rms_norm(q, eps), cos, sin)  # [T, H, hd]
        kv = apply_rope(rms_norm(F.linear(x, self.wkv), self.kv_norm, eps), cos, sin)  # [T, hd]
        comp_rows = self.compressor.project(x, positions) if self.compressor is not None else None
        idx_rows = self.indexer.compressor.project(x, positions) if self.indexer is not None else None
        if isinstance(ctx, DecodeBatch):
            out = attention_decode.attend(self, q, kv, x, q_res, cos, sin, comp_rows, idx_rows,
                                          rope.compress_table, ctx, layer)
        else:
            out = self._attend_sequences(q, kv, x, q_res, cos, sin, comp_rows, idx_rows, rope, ctx, layer)
        out = apply_rope(out.to(x.dtype), cos, sin, inverse=True)  # undo V's rotation
        grouped = out.view(x.shape[0], cfg.o_groups, -1)  # [T, G, H·hd/G]
        wo_a = self.wo_a.view(cfg.o_groups, cfg.o_lora_rank, -1)
        low = torch.einsum("tgi,goi->tgo", grouped, wo_a).flatten(1)  # [T, G·o_lora]
        return F.linear(low, self.wo_b)

    def _attend_sequences(self, q, kv, x, q_res, cos, sin, comp_rows, idx_rows, rope: StepRope,
                          seqs: list[SeqSlice], layer: int) -> torch.Tensor:
        """The per-sequence path: each sequence reads and writes its own state. Returns [T, H, hd] fp32."""
        idx_q = idx_w = None
        # Index queries matter only once some sequence has more entries than top-k.
        if self.indexer is not None and max((s.start + s.length) // self.ratio for s in seqs) > self.indexer.topk:
            idx_q, idx_w = self.indexer.queries(q_res, x, cos, sin)
        out = torch.empty(x.shape[0], self.cfg.num_heads, self.cfg.head_dim, dtype=torch.float32, device=x.device)
        for s in seqs:
            st: LayerState = s.state.layers[layer]
            sl = slice(s.begin, s.end)
            entries = mask = None
            if self.compressor is not None:
                count = self.compressor.step(st.compressor, comp_rows[sl], s.start, rope.compress_table, x.dtype)
                entries = st.compressor.entries.read(count)
                pos = torch.arange(s.start, s.start + s.length, device=x.device)
                mask = torch.arange(count, device=x.device)[None, :] < ((pos + 1) // self.ratio)[:, None]
                if self.indexer is not None:
                    n_keys = self.indexer.compressor.step(
                        st.indexer, idx_rows[sl], s.start, rope.compress_table, x.dtype)
                    keys = st.indexer.entries.read(n_keys)
                    if idx_q is not None:
                        mask = self.indexer.select(idx_q[sl], idx_w[sl], keys, mask)
            out[sl] = self._attend(q[sl].float(), kv[sl], st, s.start, entries, mask)
        return out

    def _attend(self, q: torch.Tensor, kv_new: torch.Tensor, st: LayerState, start: int,
                entries: torch.Tensor | None, entry_mask: torch.Tensor | None) -> torch.Tensor:
        """Sliding-window + compressed-entry attention with a sink for one sequence.

        q: [n, H, hd] fp32; kv_new: [n, hd]; entries: [E, hd]; entry_mask: [n, E] (True = attend).
        """
        n = q.shape[0]
        window = self.cfg.sliding_window
        kbase = max(0, start - window + 1)
        keys = torch.cat((st.window.read(kbase, start), kv_new), dim=0).float()  # positions [kbase, start+n)
        st.window.write(start, kv_new)
        comp = entries.float() if entries is not None and entries.shape[0] else None
        scale = self.cfg.head_dim**-0.5
        sink = self.attn_sink.float().view(1, -1, 1)
        out = torch.empty_like(q)
        for a in range(0, n, QUERY_BLOCK):
            b = min(n, a + QUERY_BLOCK)
            qpos = torch.arange(start + a, start + b, device=q.device)
            lo = max(kbase, start + a - window + 1)
            k = keys[lo - kbase : start + b - kbase]  # [L, hd]
            kpos = torch.arange(lo, start + b, device=q.device)
            in_window = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
            logits = torch.einsum("nhd,ld->nhl", q[a:b], k) * scale
            logits = logits.masked_fill(~in_window[:, None, :], float("-inf"))
            parts = [logits]
            if comp is not None:
                clog = torch.einsum("nhd,ed->nhe", q[a:b], comp) * scale
                parts.append(clog.masked_fill(~entry_mask[a:b, None, :], float("-inf")))
            parts.append(sink.expand(b - a, -1, 1))
            probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
            o = torch.einsum("nhl,ld->nhd", probs[..., : k.shape[0]], k)
            if comp is not None:
                o = o + torch.einsum("nhe,ed->nhd", probs[..., k.shape[0] : -1], comp)
            out[a:b] = o
        return out
