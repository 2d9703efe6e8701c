"""V4.1 attention for one sequence chunk: sliding window plus CSA2 shared compressed KV.

Every layer attends over its own last `window` window-KV rows; a layer with compress ratio
r > 0 also attends over up to `index_topk` entries of its group's shared compressed KV.
Only a KV-source layer compresses (ratio 2: softmax-gated pairs in fp32, no ape; ratio 1:
norm(wkv·x)); it also publishes the group's index keys k_norm(wk·latent) from the pre-RoPE
latent. Index-source layers score those keys with their own wq_b / weights_proj; the
candidate source keeps the best `candidate_topk_blocks` blocks (newest pinned) and later index
sources choose only inside them; every other layer reuses the last index source's choice.
A chunk is any run of tokens at positions [pos0, pos0 + T): REF's prefill (pos0 = 0) and its
one-token decode are the two cases it must reproduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .quant import fake_fp4_e4m3, fake_fp4_e8m0, fake_fp8
from .ref_ops import (apply_rope, bf16_grouped_linear, bf16_linear, fp32_linear, is_row_independent,
                      quantized_linear, rms_norm, rope_frequencies, rope_rotation, softmax, sparse_attention)
from .ref_state import ForwardHandoff, IndexTrace, SequenceState, SourceState
from .release_checkpoint import V41Config

PRIMARY = "owner_publishes_first"  # every index-key owner scores against its own keys
AS_SHIPPED = "as_shipped"  # REF as released: a non-publishing owner reads the last publisher's keys


@dataclass(frozen=True)
class RefOptions:
    """How the reference runs. `variant`: which golden variant's index-key rule (PRIMARY is the
    model as defined). `row_independent`: run under `row_independent_numerics()` (see ref_ops),
    so that decode, chunked prefill and full prefill agree bit for bit. REF is not
    row-independent, so the golden comparisons use the default."""

    variant: str = PRIMARY
    row_independent: bool = False


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] of the k largest scores per row (in no particular order): REF's
    torch.topk, or ties toward the lowest position under row-independent numerics."""
    if is_row_independent():
        return torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    return scores.topk(k, dim=-1, sorted=False).indices


def layer_freqs(cfg: V41Config, layer: int) -> torch.Tensor:
    """Window-only layers (and DSpark stages): rope_theta, no YaRN. Layers with a compressed
    branch: compress_rope_theta with YaRN, for their queries, window keys and entries alike."""
    if cfg.compress_ratios[layer]:
        return rope_frequencies(cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn)
    return rope_frequencies(cfg.rope_dim, cfg.rope_theta, None)


def project_q(w: dict, p: str, cfg: V41Config, x: torch.Tensor, rot: torch.Tensor):
    """x [T, dim] → qr [T, q_lora] (q_norm(wq_a x)) and q [T, H, D] post-RoPE. V4.1 has no
    per-head q RMSNorm (V4's reference had one)."""
    qr = rms_norm(quantized_linear(x, w[f"{p}.wq_a.weight"]), w[f"{p}.q_norm.weight"], cfg.norm_eps)
    q = quantized_linear(qr, w[f"{p}.wq_b.weight"]).unflatten(-1, (cfg.n_heads, cfg.head_dim))
    return qr, apply_rope(q, rot)


def window_entries(w: dict, p: str, cfg: V41Config, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Window KV rows [T, D] bf16: kv_norm(wkv x), RoPE, then fake FP8 (ue8m0 per 32) over the
    whole post-RoPE vector, rope channels included."""
    kv = rms_norm(quantized_linear(x, w[f"{p}.wkv.weight"]), w[f"{p}.kv_norm.weight"], cfg.norm_eps)
    return fake_fp8(apply_rope(kv, rot))


def window_index(positions: torch.Tensor, base: int, window: int) -> torch.Tensor:
    """Rows (of a buffer whose row 0 is position `base`) of positions t-window+1..t per query,
    ascending, -1 for slots before the sequence start — laid out exactly as REF lays them out,
    since the masked slots' places change the fp32 reduction order inside sparse_attn:
      * a chunk at position 0 (REF's prefill): min(T, window) columns starting at
        max(t - window + 1, 0), the slots past t at the end as -1;
      * any later chunk (REF's decode, ring order oldest first): `window` columns, the slots
        before the sequence start first, as -1.
    """
    t = positions[:, None]
    if int(positions[0]) == 0:
        pos = (t - window + 1).clamp_min(0) + torch.arange(min(positions.numel(), window))
        return torch.where(pos <= t, pos - base, -1)
    pos = t - window + 1 + torch.arange(window)
    return torch.where(pos >= 0, pos - base, -1)


def attend_window(state_rows: dict, key, new_rows: torch.Tensor, pos0: int, window: int):
    """Append this chunk's rows; return (rows covering [pos0 - kept, pos0 + T), their base
    position) and keep only the last `window` rows for the next chunk."""
    hist = state_rows.get(key, new_rows[:0])
    rows = torch.cat([hist, new_rows])
    state_rows[key] = rows[-window:]
    return rows, pos0 - hist.shape[0]


def output_projection(w: dict, p: str, cfg: V41Config, o: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """o [T, H, D] → [T, dim]: inverse RoPE, block-diagonal wo_a per group (bf16 einsum), wo_b."""
    o = apply_rope(o, rot, inverse=True).flatten(1).unflatten(-1, (cfg.o_groups, -1))  # [T, G, H/G·D]
    wo_a = w[f"{p}.wo_a.weight"].unflatten(0, (cfg.o_groups, cfg.o_lora_rank))  # [G, R, H/G·D] bf16
    o = bf16_grouped_linear(o, wo_a)  # [T, G, R]
    return quantized_linear(o.flatten(1), w[f"{p}.wo_b.weight"])


# ---- compressor and index keys (KV-source layers) -------------------------------------------


def new_latents(w: dict, p: str, cfg: V41Config, ratio: int, x: torch.Tensor, src: SourceState) -> torch.Tensor:
    """Pre-RoPE latents [G, D] bf16 of the groups this chunk completes; updates the tail."""
    if ratio == 1:  # one token per group: no gate, no fp32, bf16 weight
        return rms_norm(bf16_linear(x, w[f"{p}.compressor.wkv.weight"]), w[f"{p}.compressor.norm.weight"],
                        cfg.norm_eps)
    xf = x.float()  # ratio 2 pools in fp32 (REF promotes wkv / wgate to fp32)
    kv = torch.cat([src.pending_kv, fp32_linear(xf, w[f"{p}.compressor.wkv.weight"])])
    score = torch.cat([src.pending_score, fp32_linear(xf, w[f"{p}.compressor.wgate.weight"])])
    full = kv.shape[0] // ratio * ratio
    src.pending_kv, src.pending_score = kv[full:], score[full:]
    kv, score = kv[:full].unflatten(0, (-1, ratio)), score[:full].unflatten(0, (-1, ratio))  # [G, r, D]
    pooled = (kv * softmax(score, dim=1)).sum(dim=1)  # per-channel softmax over the group's tokens
    return rms_norm(pooled.to(torch.bfloat16), w[f"{p}.compressor.norm.weight"], cfg.norm_eps)


def publish_groups(w: dict, p: str, cfg: V41Config, layer: int, latents: torch.Tensor, src: SourceState) -> None:
    """Index keys and compressed KV of new groups. Group j stands for its first token, so both
    rotate at position j·ratio (compress rope). Keys come from the latent before its RoPE."""
    ratio = cfg.compress_ratios[layer]
    first = src.compressed_kv.shape[0]
    rot = rope_rotation(torch.arange(first, first + latents.shape[0]) * ratio, layer_freqs(cfg, layer))
    k = rms_norm(bf16_linear(latents, w[f"{p}.indexer.wk.weight"]), w[f"{p}.indexer.k_norm.weight"], cfg.norm_eps)
    src.index_keys = torch.cat([src.index_keys, fake_fp4_e8m0(apply_rope(k, rot), cfg.fp4_block_size)])
    src.compressed_kv = torch.cat([src.compressed_kv, fake_fp4_e4m3(apply_rope(latents, rot), 16)])


# ---- indexer and the two-level top-k ----------------------------------------------------------


def index_scores(w: dict, p: str, cfg: V41Config, x: torch.Tensor, qr: torch.Tensor, rot: torch.Tensor,
                 keys: torch.Tensor) -> torch.Tensor:
    """[T, N] bf16: Σ_h w_{t,h} · ReLU(q_{t,h} · k_n), everything in bf16 as REF (which is
    what makes exact ties common). q = fake FP4 (ue8m0/32) of RoPE(wq_b qr); the head weights
    weights_proj(x) carry the factor Di^-1/2 · Hi^-1/2."""
    q = quantized_linear(qr, w[f"{p}.indexer.wq_b.weight"]).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
    q = fake_fp4_e8m0(apply_rope(q, rot), cfg.fp4_block_size)
    weights = bf16_linear(x, w[f"{p}.indexer.weights_proj.weight"]) * (
        cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)  # [T, Hi] bf16
    # fp4 × fp4 dot products are exact in fp32, so this is REF's bf16 einsum to the bit
    scores = torch.einsum("thd,nd->thn", q.float(), keys.float()).to(torch.bfloat16)  # [T, Hi, N]
    return (scores.relu() * weights[..., None]).sum(dim=1)  # bf16 product, fp32-accumulated head sum


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one: bool [T, N], True inside the `topk_blocks` best blocks of `block` positions.

    A block scores its best position (invisible ones are already −inf); the block holding the
    query's newest visible position is pinned (+inf); blocks still at −inf are never kept."""
    n = scores.shape[-1]
    blocks = F.pad(scores, (0, -n % block), value=-math.inf).unflatten(-1, (-1, block)).amax(-1)  # [T, nb]
    newest = (visible - 1).div(block, rounding_mode="floor")  # -1 when nothing is visible
    blocks = blocks.masked_fill(torch.arange(blocks.shape[-1]) == newest[:, None], math.inf)
    k = min(topk_blocks, blocks.shape[-1])
    top = top_indices(blocks, k) if is_row_independent() else blocks.topk(k, dim=-1).indices  # [T, k], REF: sorted
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top, blocks.gather(-1, top) > -math.inf)
    return keep.repeat_interleave(block, dim=-1)[:, :n]


def choose_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The k best positions per query, ascending; a pick the query cannot see becomes -1."""
    idx = top_indices(scores, k).sort(dim=-1).values
    return torch.where(idx < visible[:, None], idx, -1)


def index_key_owner(cfg: V41Config, layer: int, state: SequenceState, handoff: ForwardHandoff, variant: str) -> int:
    """Whose index keys `layer` scores against (see the variants above)."""
    if variant == AS_SHIPPED and layer not in handoff.published:
        return state.last_key_publisher  # REF as released: whoever published last
    return cfg.kv_source_of(layer)


def select(w: dict, p: str, cfg: V41Config, layer: int, x, qr, rot, positions, state: SequenceState,
           handoff: ForwardHandoff, opts: RefOptions) -> torch.Tensor:
    """An index source's choice [T, k] of compressed positions (-1 = none); hands it on."""
    ratio = cfg.compress_ratios[layer]
    n = (int(positions[-1]) + 1) // ratio  # entries existing after this chunk
    visible = (positions + 1) // ratio  # entry j is visible once its group is complete
    keys = state.sources[index_key_owner(cfg, layer, state, handoff, opts.variant)].index_keys[:n]
    scores = index_scores(w, p, cfg, x, qr, rot, keys)
    scores = scores.masked_fill(torch.arange(n) >= visible[:, None], -math.inf)
    if layer == cfg.candidate_source_layer:
        handoff.candidates = candidate_blocks(scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
    elif 0 <= cfg.candidate_source_layer < layer:  # level two: only inside the candidate blocks
        scores = scores.masked_fill(~handoff.candidates, -math.inf)
    chosen = choose_topk(scores, visible, min(cfg.index_topk, n))
    handoff.trace[layer] = IndexTrace(chosen, scores)
    handoff.topk = chosen
    return chosen


def compressed_branch(w: dict, p: str, cfg: V41Config, layer: int, x, qr, rot, positions, state: SequenceState,
                      handoff: ForwardHandoff, opts: RefOptions):
    """(compressed KV [N, D] of the group, chosen positions [T, k]) for a ratio>0 layer."""
    source = cfg.kv_source_of(layer)
    if layer == source:
        src = state.sources.setdefault(layer, SourceState.empty(cfg.head_dim, cfg.index_head_dim))
        latents = new_latents(w, p, cfg, cfg.compress_ratios[layer], x, src)
        if latents.shape[0]:
            publish_groups(w, p, cfg, layer, latents, src)
            handoff.published.add(layer)
            state.last_key_publisher = layer
    n = (int(positions[-1]) + 1) // cfg.compress_ratios[layer]
    if layer in cfg.index_source_layers:
        if n:
            select(w, p, cfg, layer, x, qr, rot, positions, state, handoff, opts)
        else:  # no entry exists yet: nothing to score
            handoff.topk = torch.zeros(x.shape[0], 0, dtype=torch.long)
    return state.sources[source].compressed_kv[:n], handoff.topk


def attention(w: dict, cfg: V41Config, layer: int, x: torch.Tensor, pos0: int, state: SequenceState,
              handoff: ForwardHandoff, opts: RefOptions = RefOptions()) -> torch.Tensor:
    """Backbone attention of `layer` for a chunk x [T, dim] (bf16) at positions pos0.. → [T, dim]."""
    p = f"layers.{layer}.attn"
    positions = torch.arange(pos0, pos0 + x.shape[0])
    rot = rope_rotation(positions, layer_freqs(cfg, layer))
    qr, q = project_q(w, p, cfg, x, rot)
    rows, base = attend_window(state.window_kv, layer, window_entries(w, p, cfg, x, rot), pos0, cfg.window)
    kv, idx = rows, window_index(positions, base, cfg.window)
    if cfg.compress_ratios[layer]:
        ckv, chosen = compressed_branch(w, p, cfg, layer, x, qr, rot, positions, state, handoff, opts)
        kv = torch.cat([rows, ckv])
        idx = torch.cat([idx, torch.where(chosen >= 0, chosen + rows.shape[0], -1)], dim=-1)
    o = sparse_attention(q, kv, idx, w[f"{p}.attn_sink"], cfg.head_dim**-0.5)
    return output_projection(w, p, cfg, o, rot)
