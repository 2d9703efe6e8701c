"""V4.1 attention of one layer for a step's chunks: sliding window plus CSA2 shared compressed KV.

Projections run once over the step's flattened tokens; everything that reads a sequence's
history runs per chunk (`Chunk`: a sequence's positions [start, start + length)). Per chunk:
  * window: this chunk's fake-FP8 window rows are written to the sequence's window pool; a
    query at t sees positions t − window + 1..t, the key rows laid out as REF lays them out
    (prefill chunks at position 0: min(T, window) columns from max(t − window + 1, 0), slots past
    t at the end; later chunks: `window` columns, those before the sequence start first);
  * compressed branch (ratio > 0): a KV source pools the groups the chunk completes (ratio 2:
    fp32 softmax-gated pairs, the tail of a group still filling kept in the state pool; ratio 1:
    norm(wkv·x) per token) and publishes each group's compressed KV (after RoPE, FP4 e4m3/16) and
    index key (k_norm(wk·latent) from the pre-RoPE latent, RoPE, FP4 ue8m0/32). Index sources
    score their group's keys; the candidate source keeps the best blocks (newest pinned) and
    later index sources choose inside them; other layers reuse the last source's choice
    (`Chunk.handoff`). Entry j is visible to query t iff j < (t + 1) // ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import numerics as nx
from .linear import Param, QLinear


@dataclass
class Chunk:
    """One sequence's share of a step."""

    seq: object  # V41Sequence
    start: int  # absolute position of the first token
    begin: int  # its first row in the flattened step
    length: int
    handoff: dict = field(default_factory=dict)  # 'topk', 'candidates' of this forward
    trace: dict | None = None  # index-source layer → (chosen, scores), when tracing
    # Decoder tail: this layer computed no window rows below this position in this forward (its
    # rows there are a recycled block's bytes); the queries attend none of them, as vLLM's replay.
    window_floor: int = 0

    @property
    def rows(self) -> slice:
        return slice(self.begin, self.begin + self.length)

    @property
    def end(self) -> int:
        return self.start + self.length


class Compressor(nn.Module):
    """A KV source's compressor: ratio 2 pools pairs with an fp32 softmax gate, ratio 1 keeps
    every token's latent (no gate)."""

    def __init__(self, dim: int, head_dim: int, ratio: int):
        super().__init__()
        self.ratio = ratio
        dtype = torch.float32 if ratio > 1 else torch.bfloat16  # REF promotes the ratio-2 weights to fp32
        self.wkv = Param(head_dim, dim, dtype=dtype)
        if ratio > 1:
            self.wgate = Param(head_dim, dim, dtype=torch.float32)
        self.norm = Param(head_dim)


class Indexer(nn.Module):
    """An index source's query side (wq_b on qr, weights_proj); a KV source also owns the key
    projection of its group's latents (wk, k_norm)."""

    def __init__(self, cfg, owns_keys: bool):
        super().__init__()
        self.wq_b = QLinear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = Param(cfg.index_n_heads, cfg.hidden_size)
        if owns_keys:
            self.wk = Param(cfg.index_head_dim, cfg.head_dim)
            self.k_norm = Param(cfg.index_head_dim)


class Attention(nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        v = cfg.v41
        self.ratio = cfg.compress_ratios[layer] if layer < cfg.num_layers else 0
        h, d = cfg.num_heads, cfg.head_dim
        self.wq_a = QLinear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = Param(cfg.q_lora_rank)
        self.wq_b = QLinear(cfg.q_lora_rank, h * d)
        self.wkv = QLinear(cfg.hidden_size, d)
        self.kv_norm = Param(d)
        self.wo_a = QLinear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = QLinear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(h, dtype=torch.float32), requires_grad=False)
        self.is_source = layer in v.kv_source_layers
        self.is_index = layer in v.index_source_layers
        if self.is_source:
            self.compressor = Compressor(cfg.hidden_size, d, self.ratio)
        if self.is_index:
            self.indexer = Indexer(cfg, self.is_source)

    # ---- projections (all rows at once) ---------------------------------------------------------
    def project_q(self, x: torch.Tensor, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim] → qr [T, q_lora] = q_norm(wq_a x) and q [T, H, D] after RoPE (V4.1 has no
        per-head q norm)."""
        eps = self.cfg.rms_norm_eps
        qr = nx.rms_norm(self.wq_a(x), self.q_norm.weight, eps)
        q = self.wq_b(qr).unflatten(-1, (self.cfg.num_heads, self.cfg.head_dim))
        return qr, nx.apply_rope(q, rot)

    def window_rows(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """Window KV rows before their fake FP8: RoPE(kv_norm(wkv x)) [T, D] bf16."""
        return nx.apply_rope(nx.rms_norm(self.wkv(x), self.kv_norm.weight, self.cfg.rms_norm_eps), rot)

    def output(self, o: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """o [T, H, D] → [T, dim]: inverse RoPE, block-diagonal wo_a per group (a bf16 einsum on
        the dequantized weight, no activation quantization), then wo_b."""
        cfg = self.cfg
        o = nx.apply_rope(o, rot, inverse=True).flatten(1).unflatten(-1, (cfg.o_groups, -1))  # [T, G, H·D/G]
        if getattr(self, "_wo_a", None) is None or self._wo_a.device != o.device:
            self._wo_a = self.wo_a.bf16_values().unflatten(0, (cfg.o_groups, cfg.o_lora_rank))  # [G, R, H·D/G]
        return self.wo_b(nx.bf16_grouped_gemm(o, self._wo_a).flatten(1))

    # ---- the layer ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, positions: torch.Tensor, rot: torch.Tensor, chunks: list[Chunk],
                freqs: torch.Tensor) -> torch.Tensor:
        """x [T, dim] bf16 at `positions` [T] (rotation `rot`) → [T, dim] bf16."""
        cfg = self.cfg
        qr, q = self.project_q(x, rot)
        win = self.window_rows(x, rot)  # [T, D], quantized on its way into the pool
        iq = None
        if self.is_index and any(c.end // self.ratio for c in chunks):
            iq = self.index_queries(qr, rot)
        o = torch.empty_like(q)
        for c in chunks:
            r = c.rows
            rows, base = self._window(c, win[r])
            kv, idx = rows, window_index(positions[r], base, cfg.sliding_window, c.window_floor, c.start)
            if self.ratio:
                ckv, chosen = self._compressed(c, x[r], iq[r] if iq is not None else None, positions[r], freqs)
                kv = torch.cat([rows, ckv])
                idx = torch.cat([idx, torch.where(chosen >= 0, chosen + rows.shape[0], -1)], dim=-1)
            o[r] = nx.sparse_attention(q[r], kv, idx, self.attn_sink, cfg.head_dim**-0.5)
        return self.output(o, rot)

    def _window(self, c: Chunk, new: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Write the chunk's window rows; return (rows of positions [base, end), base)."""
        view = c.seq.window(self.layer)
        base = max(0, c.start - self.cfg.sliding_window + 1)
        view.write(c.start, new)
        return view.read(base, c.end), base

    # ---- compressed branch --------------------------------------------------------------------
    def _compressed(self, c: Chunk, x: torch.Tensor, iq, positions: torch.Tensor, freqs: torch.Tensor):
        """(compressed KV rows the chunk's queries may pick, chosen [n, k] indices into them)."""
        cfg, m = self.cfg, self.ratio
        if self.is_source:
            self._publish(c, x, freqs)
        n = c.end // m  # entries that exist after this chunk
        if self.is_index:
            if n:
                self._select(c, x, iq, positions, n)
            else:
                c.handoff["topk"] = torch.zeros(c.length, 0, dtype=torch.long, device=x.device)
        # The entries the chunk's queries picked, each read once: chosen on the host (one read of
        # the picks on a GPU, where a mask index and `unique` would each be a read).
        chosen = c.handoff["topk"].cpu()
        picked = chosen[chosen >= 0]
        needed = torch.unique(picked) if picked.numel() else picked  # ascending entry indices
        rows = c.seq.entries(self.layer).read_some(needed.to(x.device)) if needed.numel() else \
            torch.zeros(0, cfg.head_dim, dtype=torch.bfloat16, device=x.device)
        local = torch.searchsorted(needed, chosen.clamp_min(0))
        return rows, torch.where(chosen >= 0, local, -1).to(x.device)

    def _latents(self, c: Chunk, x: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(first new group, pre-RoPE latents [G, D] bf16 of the groups the chunk completes)."""
        comp, eps, m = self.compressor, self.cfg.rms_norm_eps, self.ratio
        if m == 1:  # one token per group: bf16 weight, no gate
            return c.start, nx.rms_norm(nx.bf16_gemm(x, comp.wkv.weight), comp.norm.weight, eps)
        tail_view = c.seq.tail(self.layer)
        held = c.start % m  # tokens of the group in progress computed by earlier chunks
        xf = x.float()
        new = torch.cat([nx.fp32_gemm(xf, comp.wkv.weight), nx.fp32_gemm(xf, comp.wgate.weight)], dim=-1)  # [n, 2D]
        tail_view.write(c.start, new)
        rows = torch.cat([tail_view.read(c.start - held, c.start), new]) if held else new
        full = rows.shape[0] // m * m
        d = self.cfg.head_dim
        kv = rows[:full, :d].unflatten(0, (-1, m))  # [G, m, D]
        score = rows[:full, d:].unflatten(0, (-1, m))
        pooled = (kv * nx.softmax(score, dim=1)).sum(dim=1)  # per-channel softmax over the group
        return (c.start - held) // m, nx.rms_norm(pooled.to(torch.bfloat16), comp.norm.weight, eps)

    def _publish(self, c: Chunk, x: torch.Tensor, freqs: torch.Tensor) -> None:
        """Compressed KV and index keys of the groups this chunk completes. Group j stands for its
        first token: both rotate at position j·ratio; the key comes from the pre-RoPE latent."""
        first, latents = self._latents(c, x)
        if not latents.shape[0]:
            return
        ix, eps = self.indexer, self.cfg.rms_norm_eps
        rot = nx.rotation(torch.arange(first, first + latents.shape[0], device=x.device) * self.ratio, freqs)
        k = nx.rms_norm(nx.bf16_gemm(latents, ix.wk.weight), ix.k_norm.weight, eps)
        c.seq.keys(self.layer).write(first, nx.apply_rope(k, rot))
        c.seq.entries(self.layer).write(first, nx.apply_rope(latents, rot))

    def index_queries(self, qr: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """FP4 (ue8m0/32) index queries [T, Hi, Di] of RoPE(wq_b qr)."""
        from .quant import fake_fp4_index

        cfg = self.cfg
        q = self.indexer.wq_b(qr).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
        return fake_fp4_index(nx.apply_rope(q, rot), 32)

    def _select(self, c: Chunk, x: torch.Tensor, iq: torch.Tensor, positions: torch.Tensor, n: int) -> None:
        """This index source's choice [n_rows, k] (−1 = none), handed to the layers after it."""
        cfg, v = self.cfg, self.cfg.v41
        visible = (positions + 1) // self.ratio
        keys = c.seq.keys(self.layer).read(n)  # the group source's keys (owner publishes first)
        weights = nx.bf16_gemm(x, self.indexer.weights_proj.weight) * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        # fp4 × fp4 products are exact in fp32: REF's bf16 einsum to the bit
        dots = torch.einsum("thd,nd->thn", iq.float(), keys.float()).to(torch.bfloat16)  # [T, Hi, N]
        scores = (dots.relu() * weights[..., None]).sum(dim=1)  # bf16, head sum accumulated in fp32
        scores = scores.masked_fill(torch.arange(n, device=x.device) >= visible[:, None], -math.inf)
        if self.layer == v.candidate_source_layer:
            c.handoff["candidates"] = candidate_blocks(scores, visible, v.candidate_topk_blocks, v.candidate_block_size)
        elif 0 <= v.candidate_source_layer < self.layer:  # level two: only inside the candidate blocks
            scores = scores.masked_fill(~c.handoff["candidates"], -math.inf)
        idx = nx.top_indices(scores, min(cfg.index_topk, n)).sort(dim=-1).values
        chosen = torch.where(idx < visible[:, None], idx, -1)
        c.handoff["topk"] = chosen
        if c.trace is not None:
            c.trace[self.layer] = (chosen, scores)


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one: bool [T, N], True inside the `topk_blocks` best blocks of `block` positions
    (a block scores its best position; the block of the newest visible position is pinned;
    blocks at −inf are never kept)."""
    n = scores.shape[-1]
    blocks = F.pad(scores, (0, -n % block), value=-math.inf).unflatten(-1, (-1, block)).amax(-1)  # [T, nb]
    newest = (visible - 1).div(block, rounding_mode="floor")
    blocks = blocks.masked_fill(torch.arange(blocks.shape[-1], device=scores.device) == newest[:, None], math.inf)
    k = min(topk_blocks, blocks.shape[-1])
    top = nx.top_indices(blocks, k, sorted_ref=True)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top, blocks.gather(-1, top) > -math.inf)
    return keep[..., None].expand(*keep.shape, block).flatten(-2)[:, :n]  # each block's flag over its positions


def window_index(positions: torch.Tensor, base: int, window: int, floor: int = 0,
                 first: int | None = None) -> torch.Tensor:
    """Key rows (of a buffer whose row 0 is position `base`) of positions t − window + 1..t per
    query, −1 for slots before the sequence start or below `floor`, in REF's layout (see the
    module docstring). `first`: positions[0] when the caller knows it (no read of the tensor)."""
    t = positions[:, None]
    if (int(positions[0]) if first is None else first) == 0:
        pos = (t - window + 1).clamp_min(0) + torch.arange(min(positions.numel(), window), device=t.device)
        return torch.where((pos <= t) & (pos >= floor), pos - base, -1)
    pos = t - window + 1 + torch.arange(window, device=t.device)
    return torch.where(pos >= max(0, floor), pos - base, -1)
