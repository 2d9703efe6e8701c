"""DeepSeek-V4.1's decode/verify forward in static shapes: B sequences × q tokens over a
`DecodeBatch` (engine/decode_batch.py), no host read and no data-dependent shape, so that it can
be captured as a CUDA graph (engine/v41/static_decode.py).

The maths is the eager forward's (engine/v41/model.py, attention.py), stated over fixed-size
gathers instead of per-chunk Python loops:
  * window: query t reads the `window` positions t − window + 1..t through the sliding table,
    those before the sequence start masked (the eager decode layout, column for column);
  * CSA2 source: every token's compressor candidate is computed — ratio 2 pools the state row
    before the step with the step's rows, a token completing a group (p + 1 ≡ 0 mod ratio)
    publishes its entry and index key, the others write to the dummy block;
  * index source: scores against every entry the full table can address (E = C / ratio), those
    past the query's visible count at −inf; candidate blocks and top-k as eager with k =
    min(index_topk, E); the picked entries are read through the block tables (no `unique`);
  * Engram: hash ids come with the step's tables (computed on the host from its token ids when
    the step is filled);
  * MoE: engine/v41/static_moe.py.

Row-count-dependent operations (fp32 GEMMs, sigmoid / softplus / silu / exp, attention sums) run
in `row_groups`: per sequence under reference numerics on a CPU — the eager path's per-chunk
calls, hence its bits — else once over all rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import numerics as nx
from .attention import Attention, candidate_blocks
from .model import identity_pre, per_chunk
from .static_moe import static_moe


@dataclass(frozen=True)
class Rows:
    """The rows of one call (what `per_chunk` reads of a Chunk)."""

    rows: slice


def row_groups(num: int, size: int, device: torch.device) -> list[Rows]:
    """How row-count-dependent operations are called over `num` sequences of `size` rows: per
    sequence under reference numerics on a CPU (REF's CPU kernels round by row count, and the
    eager path calls them per chunk), else once (row-independent numerics make no difference;
    a GPU's kernels are not REF's anyway, and per-sequence calls would multiply a graph's nodes)."""
    if nx.current().row_independent or torch.device(device).type != "cpu" or num == 1:
        return [Rows(slice(0, num * size))]
    return [Rows(slice(i * size, (i + 1) * size)) for i in range(num)]


@dataclass
class StepContext:
    """What every layer of one static forward shares."""

    batch: object  # DecodeBatch (int64 tables on the model's device)
    cache: object  # V41KVCache
    groups: list[Rows]
    rot_main: torch.Tensor  # complex64 [N, rope/2]: window-only layers
    rot_compress: torch.Tensor  # ratio > 0 layers
    freqs_compress: torch.Tensor
    engram_rows: list[torch.Tensor] = field(default_factory=list)  # per Engram layer, when looked up on the host
    handoff: dict = field(default_factory=dict)  # 'topk', 'candidates' of the last index / candidate source

    @property
    def shape(self) -> tuple[int, int]:
        return self.batch.num_seqs, self.batch.tokens_per_seq

    def pool(self, name: str, layer: int):
        """(pool, the layer whose tensor `layer` reads and writes: its source's for c/idx/state)."""
        return self.cache.pools[name], self.cache.layout.source_layer(name, layer)


def attend_rows(attn: Attention, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] over per-query keys [n, L, D] (valid [n, L]) → [n, H, D] bf16: the eager
    sparse attention, its columns in the same order."""
    n, length = valid.shape
    idx = torch.where(valid, torch.arange(n * length, device=q.device).view(n, length), -1)
    return nx.sparse_attention(q, keys.flatten(0, 1), idx, attn.attn_sink, attn.cfg.head_dim**-0.5)


# ---- attention -------------------------------------------------------------------------------------


def static_attention(attn: Attention, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """x [N, dim] bf16 → [N, dim] bf16 (Attention.forward over a DecodeBatch)."""
    rot = ctx.rot_compress if attn.ratio else ctx.rot_main
    qr, q = attn.project_q(x, rot)
    keys, valid = _window(attn, attn.window_rows(x, rot), ctx)  # [N, W, D], [N, W]
    if attn.ratio:
        if attn.is_source:
            _publish(attn, x, ctx)
        if attn.is_index:
            _select(attn, x, qr, rot, ctx)
        entries, picked = _picked_entries(attn, ctx.handoff["topk"], ctx)  # [N, K, D], [N, K]
        keys, valid = torch.cat([keys, entries], dim=1), torch.cat([valid, picked], dim=1)
    o = per_chunk(lambda q_, k_, v_: attend_rows(attn, q_, k_, v_), ctx.groups, q, keys, valid)
    return attn.output(o, rot)


def _window(attn: Attention, rows: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's window rows, then read each query's window: ([N, W, D], valid [N, W])."""
    batch, (b, q), w = ctx.batch, ctx.shape, attn.cfg.sliding_window
    pool, layer = ctx.pool("swa", attn.layer)
    pos = batch.positions.view(b, q)
    slots, _ = batch.sliding_slots(pos)
    pool.write(layer, slots.reshape(-1), rows)  # quantized the model's way on its way in
    key_pos = pos[..., None] - (w - 1) + torch.arange(w, device=pos.device)  # [B, q, W]
    key_slots, valid = batch.sliding_slots(key_pos.view(b, q * w))  # positions < 0 invalid
    keys = pool.read(layer, key_slots.reshape(-1), ctx.cache.dtype)
    return keys.view(b * q, w, -1), valid.view(b * q, w)


def _publish(attn: Attention, x: torch.Tensor, ctx: StepContext) -> None:
    """A KV source's compressed entries and index keys of the groups its tokens complete."""
    cfg, comp, m = attn.cfg, attn.compressor, attn.ratio
    batch, (b, q), eps = ctx.batch, ctx.shape, cfg.rms_norm_eps
    pos = batch.positions.view(b, q)
    if m == 1:  # one token per group: bf16 weight, no gate
        latents = nx.rms_norm(nx.bf16_gemm(x, comp.wkv.weight), comp.norm.weight, eps)  # [N, D]
        group, completes = pos, torch.ones_like(pos, dtype=torch.bool)
    else:
        latents = _pooled_groups(attn, x, ctx).flatten(0, 1)
        group = torch.div(pos, m, rounding_mode="floor")
        completes = (pos + 1).remainder(m) == 0
    rot = nx.rotation(group.reshape(-1) * m, ctx.freqs_compress)  # group j rotates at position j·ratio
    ix = attn.indexer
    key = nx.rms_norm(nx.bf16_gemm(latents, ix.wk.weight), ix.k_norm.weight, eps)  # from the pre-RoPE latent
    target = torch.where(completes, batch.entry_slots(group, m), 0).reshape(-1)  # the rest → the dummy block
    for name, rows in ((f"idx{m}", key), (f"c{m}", latents)):
        pool, layer = ctx.pool(name, attn.layer)
        pool.write(layer, target, nx.apply_rope(rows, rot))


def _pooled_groups(attn: Attention, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """Ratio m > 1: each token's group latent [B, q, D] bf16 (meaningful where the token completes
    its group) from the m rows ending at it: the state rows before the step, then the step's."""
    cfg, comp, m, d = attn.cfg, attn.compressor, attn.ratio, attn.cfg.head_dim
    batch, (b, q) = ctx.batch, ctx.shape
    new = per_chunk(lambda xf: torch.cat([nx.fp32_gemm(xf, comp.wkv.weight), nx.fp32_gemm(xf, comp.wgate.weight)],
                                         dim=-1), ctx.groups, x.float())  # [N, 2D] fp32: [kv | score]
    pool, layer = ctx.pool(f"state_c{m}", attn.layer)
    slots, _ = batch.sliding_slots(batch.positions.view(b, q))
    pool.write(layer, slots.reshape(-1), new)
    before = batch.start[:, None] - (m - 1) + torch.arange(m - 1, device=x.device)  # [B, m − 1]
    held_slots, held_valid = batch.sliding_slots(before)
    held = pool.read(layer, held_slots.reshape(-1), torch.float32).view(b, m - 1, -1)
    held = torch.where(held_valid[..., None], held, 0.0)
    rows = torch.cat([held, new.view(b, q, -1)], dim=1)  # [B, m − 1 + q, 2D]
    spans = rows.unfold(1, m, 1).transpose(-1, -2)  # [B, q, m, 2D]: the m rows ending at each token
    kv, score = spans[..., :d], spans[..., d:]
    pooled = (kv * nx.softmax(score, dim=2)).sum(dim=2)  # per-channel softmax over the group
    return nx.rms_norm(pooled.to(torch.bfloat16), comp.norm.weight, cfg.rms_norm_eps)


def _select(attn: Attention, x: torch.Tensor, qr: torch.Tensor, rot: torch.Tensor, ctx: StepContext) -> None:
    """This index source's choice [N, K] (−1 = none), handed to the layers after it."""
    cfg, v, m = attn.cfg, attn.cfg.v41, attn.ratio
    batch, (b, q) = ctx.batch, ctx.shape
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    e = batch.max_context // m
    visible = torch.div(batch.positions + 1, m, rounding_mode="floor")  # [N]
    count = torch.div(batch.start + q, m, rounding_mode="floor")  # [B] entries after the step
    index = torch.arange(e, device=x.device).expand(b, e)
    pool, layer = ctx.pool(f"idx{m}", attn.layer)  # the group source's keys (owner publishes first)
    keys = pool.read(layer, batch.entry_slots(index, m).reshape(-1), ctx.cache.dtype).view(b, e, di)
    keys = torch.where((index < count[:, None])[..., None], keys, 0.0)
    weights = nx.bf16_gemm(x, attn.indexer.weights_proj.weight) * (di**-0.5 * hi**-0.5)  # [N, Hi]
    iq = attn.index_queries(qr, rot).view(b, q, hi, di)
    dots = torch.einsum("bqhd,bnd->bqhn", iq.float(), keys.float()).to(torch.bfloat16)  # exact fp4 × fp4 sums
    scores = (dots.relu() * weights.view(b, q, hi, 1)).sum(dim=2).view(b * q, e)  # bf16
    scores = scores.masked_fill(torch.arange(e, device=x.device) >= visible[:, None], -math.inf)
    if attn.layer == v.candidate_source_layer:
        ctx.handoff["candidates"] = candidate_blocks(scores, visible, v.candidate_topk_blocks, v.candidate_block_size)
    elif 0 <= v.candidate_source_layer < attn.layer:  # level two: only inside the candidate blocks
        scores = scores.masked_fill(~ctx.handoff["candidates"], -math.inf)
    idx = nx.top_indices(scores, min(cfg.index_topk, e)).sort(dim=-1).values
    ctx.handoff["topk"] = torch.where(idx < visible[:, None], idx, -1)


def _picked_entries(attn: Attention, chosen: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed entries the queries picked, read through the block tables: ([N, K, D],
    picked [N, K])."""
    b, _ = ctx.shape
    pool, layer = ctx.pool(f"c{attn.ratio}", attn.layer)
    slots = ctx.batch.entry_slots(chosen.clamp_min(0).view(b, -1), attn.ratio).reshape(-1)
    rows = pool.read(layer, slots, ctx.cache.dtype)
    return rows.view(*chosen.shape, -1), chosen >= 0


# ---- the model ---------------------------------------------------------------------------------------


def static_forward(model, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(final normed rows x [N, dim] bf16, DSpark main hidden [N, n_targets·dim] or None) of the
    step in `ctx.batch` (V41Model._forward in static shapes)."""
    cfg, v, batch = model.cfg, model.cfg.v41, ctx.batch
    n = batch.token_ids.shape[0]
    stream = model.embed.weight[batch.token_ids][:, None, :].repeat(1, cfg.hc_mult, 1)  # [N, hc, dim]
    pre_mix = identity_pre(n, cfg.hc_mult, stream.device)
    targets = {}
    for i, block in enumerate(model.layers):
        engram = getattr(block, "engram", None)
        if engram is not None:
            stream = engram.mix(stream, _engram_rows(engram, v.engram_layer_ids.index(i), ctx), ctx.groups)
        if i in v.dspark_target_layer_ids:  # DSpark reads the attention input
            targets[i] = stream.mean(dim=1)
        stream, pre_mix = block(stream, pre_mix, lambda x, b=block: static_attention(b.attn, x, ctx), ctx.groups,
                                ffn=lambda x, b=block: static_moe(b.ffn, x, ctx.groups))
    x = nx.rms_norm(nx.hc_collapse(stream, pre_mix), model.norm.weight, cfg.rms_norm_eps)
    main = torch.cat([targets[i] for i in v.dspark_target_layer_ids], dim=-1) if targets else None
    return x, main


def _engram_rows(engram, slot: int, ctx: StepContext) -> torch.Tensor:
    """[N, cols, head_dim] table rows of an Engram layer: gathered on the device from the step's
    hash ids, or (tables in host memory) the rows the fill gathered and copied over."""
    if ctx.engram_rows:
        return ctx.engram_rows[slot]
    return engram.lookup(ctx.batch.extra["engram"][:, slot])


def static_logits(model, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[N, dim] → fp32 [N, V]; on a CPU under reference numerics one row per GEMM, as eager."""
    head = model.head.weight
    return per_chunk(lambda r: nx.fp32_gemm(r, head), row_groups(x.shape[0], 1, device), x)
