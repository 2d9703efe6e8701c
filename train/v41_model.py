"""A trainable DeepSeek-V4.1 backbone in plain torch: the engine's forward (engine/v41/model.py,
attention.py, moe.py) over a batch of whole windows, differentiable.

`V41Params` holds one fp32 master tensor per engine parameter, under the engine's own names
(the module tree is built from `engine.v41.weights.build_v41`, so `state_dict()` names are the
names the release writer maps), initialised by the release writer's random draw. Each forward
first turns the masters into the values the release stores (`effective_weights`: FP8 32×32 /
FP4 per-32 / FP8 per-row-32 for the tensors the release quantizes, bf16 or fp32 for the rest,
all with straight-through gradients), then runs V4.1's arithmetic on them: bf16 activations,
fake-FP8 GEMM inputs and window KV, FP4 compressed KV and index q/k, delayed-pre mHC with
Sinkhorn, Engram, sqrt-softplus routing over logits / gate_temp with a selection-only bias,
clamped SwiGLU, CSA2 shared compressed KV with the two-level top-k.

Discrete choices are made exactly as the engine makes them (top-k of the bf16 index scores,
candidate blocks, router top-k) and carry no gradient: the router learns through its weights'
scores and the aux-free bias update (train/v41.py), the indexer from a KL to the main
attention's distribution over the entries it selected (`IndexRecord`), as train/v4.py trains
V4's. Each sequence starts at position 0 (a prefill); for one sequence every operation has the
engine's shapes, so with `exact` GEMMs the logits are the engine's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.v41 import numerics as nx
from engine.v41.attention import candidate_blocks, window_index
from engine.v41.checkpoint import F32_SUFFIXES, fp8_stored, random_state
from engine.v41.engram import EngramHasher
from engine.v41.model import HyperSite, identity_pre
from engine.v41.weights import build_v41

from . import v41_numerics as tq


HEAD_INIT_SCALE = 0.25


class V41Params(nn.Module):
    """fp32 masters named as the engine's parameters (backbone and DSpark stages)."""

    def __init__(self, cfg, seed: int):
        super().__init__()
        self.cfg = cfg
        init = random_state(cfg, seed)
        target = build_v41(cfg, with_dspark=cfg.num_nextn_predict_layers > 0)  # meta: names, shapes
        for name, p in target.named_parameters():
            *path, leaf = name.split(".")
            owner = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            value = init[name].float().reshape(p.shape)
            if name == "head.weight":  # the draw's ×4 head (random logits of O(10)) back to fan_in^-½
                value = value * HEAD_INIT_SCALE
            # the router bias moves by the balancing rule, never by gradient
            owner.register_parameter(leaf, nn.Parameter(value, requires_grad=not name.endswith("gate.bias")))


def stored_values(name: str, master: torch.Tensor) -> torch.Tensor:
    """fp32 values of `name` as the release stores it (fp8-fp4), gradient straight through."""
    if name.endswith(F32_SUFFIXES):
        return master
    if ".experts." in name and ".shared_experts." not in name:
        return tq.ste(master, tq.fp4_weight_values(master))
    if name.endswith("engram.embed.weight"):
        return tq.ste(master, tq.fp8_weight_values(master, (1, 32)))
    if fp8_stored(name):
        return tq.ste(master, tq.fp8_weight_values(master, (32, 32)))
    return master.to(torch.bfloat16).float()  # the cast's gradient is the identity


def effective_weights(params: V41Params) -> dict[str, torch.Tensor]:
    return {name: stored_values(name, p) for name, p in params.named_parameters()}


@dataclass
class IndexRecord:
    """One index source's selection of one forward, for the indexer's KL."""

    scores: list[torch.Tensor]  # per sequence [L, n] bf16 index scores (grad: indexer params only)
    chosen: list[torch.Tensor]  # per sequence [L, k] entry ids, −1 = none
    mass: list[torch.Tensor] = field(default_factory=list)  # per sequence [L, k] attention mass (no grad)


@dataclass
class Ctx:
    """What one forward shares across layers."""

    cfg: object
    w: dict[str, torch.Tensor]
    exact: bool
    batch: int
    length: int
    freqs_main: torch.Tensor
    freqs_compress: torch.Tensor
    sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer → (entries, keys)
    handoff: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # 'topk' / 'candidates' per sequence
    index: dict[int, IndexRecord] = field(default_factory=dict)
    router_picks: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # (MoE prefix, [N, k] experts)

    @property
    def device(self) -> torch.device:
        return self.freqs_main.device

    def gemm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return tq.quant_gemm(x, self.w[name], self.exact)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return nx.rms_norm(x, self.w[name], self.cfg.rms_norm_eps)


def new_ctx(cfg, w: dict[str, torch.Tensor], batch: int, length: int, exact: bool) -> Ctx:
    """The forward runs on the masters' device: every index tensor it makes is made there."""
    with torch.device("cpu"):  # the frequencies are the engine's: computed on the host, then moved
        main, compress = (nx.rope_freqs(cfg.rope_dim, cfg.rope_theta, None),
                          nx.rope_freqs(cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn))
    device = w["embed.weight"].device
    return Ctx(cfg, w, exact, batch, length, main.to(device), compress.to(device))


# ---- MoE ----------------------------------------------------------------------------------


def _expert(ctx: Ctx, w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None):
    """Clamped SwiGLU [n, dim] → [n, dim] bf16; the routing weight multiplies the fp32 activation."""
    limit, inter = ctx.cfg.swiglu_limit, w2.shape[-1]
    h = tq.quant_gemm(x, w13, ctx.exact)  # [n, 2·inter]: gate rows, then up rows
    gate = h[:, :inter].float().clamp(max=limit)
    up = h[:, inter:].float().clamp(-limit, limit)
    act = nx.silu(gate) * up
    if weight is not None:
        act = weight * act
    return tq.quant_gemm(act.to(torch.bfloat16), w2, ctx.exact)


def moe(ctx: Ctx, p: str, x: torch.Tensor, topk: int) -> torch.Tensor:
    """[N, dim] bf16 → [N, dim] bf16: routed experts in ascending order, the shared one last."""
    cfg, w = ctx.cfg, ctx.w
    scores = nx.softplus(nx.fp32_gemm(x, w[f"{p}.gate.weight"]) / cfg.v41.gate_temp).sqrt()  # [N, E]
    experts = (scores.detach() + w[f"{p}.gate.bias"].detach()).topk(topk, dim=-1).indices  # [N, k]
    ctx.router_picks.append((p, experts))
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    w13, w2 = w[f"{p}.experts.w13.weight"], w[f"{p}.experts.w2.weight"]
    for e in torch.unique(experts).tolist():
        tokens, choice = torch.where(experts == e)
        y = y.index_add(0, tokens, _expert(ctx, w13[e], w2[e], x[tokens], weights[tokens, choice, None]).float())
    shared = f"{p}.shared_experts"
    gate = ctx.gemm(x, f"{shared}.w1.weight").float().clamp(max=cfg.swiglu_limit)
    up = ctx.gemm(x, f"{shared}.w3.weight").float().clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
    y = y + ctx.gemm((nx.silu(gate) * up).to(torch.bfloat16), f"{shared}.w2.weight")
    return y.to(torch.bfloat16)


# ---- a block ------------------------------------------------------------------------------


def block(ctx: Ctx, p: str, stream: torch.Tensor, pre_mix: torch.Tensor, attend, topk: int):
    """Delayed-pre mHC block: stream [N, hc, dim], pre_mix [N, hc] → (stream, this FFN site's pre)."""
    cfg, w = ctx.cfg, ctx.w

    def site(name: str, s: torch.Tensor):
        return HyperSite.mixes(s, w[f"{p}.hc_{name}_fn"], w[f"{p}.hc_{name}_scale"], w[f"{p}.hc_{name}_base"], cfg)

    attn_pre, attn_post, attn_comb = site("attn", stream)
    x = ctx.norm(nx.hc_collapse(stream, pre_mix), f"{p}.attn_norm.weight")
    stream = nx.hc_expand(attend(x), stream, attn_post, attn_comb)
    ffn_pre, ffn_post, ffn_comb = site("ffn", stream)
    x = ctx.norm(nx.hc_collapse(stream, attn_pre), f"{p}.ffn_norm.weight")
    return nx.hc_expand(moe(ctx, f"{p}.ffn", x, topk), stream, ffn_post, ffn_comb), ffn_pre


# ---- attention pieces shared with the DSpark stages -----------------------------------------


def project_q(ctx: Ctx, p: str, x: torch.Tensor, rot: torch.Tensor):
    """x [N, dim] → qr [N, q_lora], q [N, H, D] after RoPE."""
    qr = ctx.norm(ctx.gemm(x, f"{p}.wq_a.weight"), f"{p}.q_norm.weight")
    q = ctx.gemm(qr, f"{p}.wq_b.weight").unflatten(-1, (ctx.cfg.num_heads, ctx.cfg.head_dim))
    return qr, nx.apply_rope(q, rot)


def window_rows(ctx: Ctx, p: str, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Window KV rows as the pool holds them: fake FP8 of RoPE(kv_norm(wkv x)) [N, D]."""
    return tq.fake_fp8(nx.apply_rope(ctx.norm(ctx.gemm(x, f"{p}.wkv.weight"), f"{p}.kv_norm.weight"), rot))


def output(ctx: Ctx, p: str, o: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """o [N, H, D] → [N, dim]: inverse RoPE, block-diagonal bf16 wo_a per group, then wo_b."""
    cfg = ctx.cfg
    o = nx.apply_rope(o, rot, inverse=True).flatten(1).unflatten(-1, (cfg.o_groups, -1))  # [N, G, H·D/G]
    wo_a = ctx.w[f"{p}.wo_a.weight"].to(torch.bfloat16).unflatten(0, (cfg.o_groups, cfg.o_lora_rank))
    return ctx.gemm(nx.bf16_grouped_gemm(o, wo_a).flatten(1), f"{p}.wo_b.weight")


# ---- the compressed branch ------------------------------------------------------------------


def _publish(ctx: Ctx, layer: int, x: torch.Tensor) -> None:
    """A KV source's compressed entries and index keys of every complete group, per sequence."""
    w, ratio = ctx.w, cfg_ratio(ctx.cfg, layer)
    p, b, L, d = f"layers.{layer}.attn", ctx.batch, ctx.length, ctx.cfg.head_dim
    if ratio == 1:
        latents = ctx.norm(nx.bf16_gemm(x, w[f"{p}.compressor.wkv.weight"]), f"{p}.compressor.norm.weight")
    else:
        xf = x.float()
        rows = torch.cat([nx.fp32_gemm(xf, w[f"{p}.compressor.wkv.weight"]),
                          nx.fp32_gemm(xf, w[f"{p}.compressor.wgate.weight"])], dim=-1).unflatten(0, (b, L))
        full = L // ratio * ratio
        kv = rows[:, :full, :d].reshape(-1, ratio, d)  # [B·G, ratio, D]
        score = rows[:, :full, d:].reshape(-1, ratio, d)
        pooled = (kv * nx.softmax(score, dim=1)).sum(dim=1)  # per-channel softmax over the group
        latents = ctx.norm(pooled.to(torch.bfloat16), f"{p}.compressor.norm.weight")
    groups = L // ratio
    latents = latents.reshape(b, -1, d)[:, :groups].reshape(b * groups, d)  # [B·G, D]
    rot = nx.rotation(torch.arange(groups, device=ctx.device).repeat(b) * ratio, ctx.freqs_compress)
    # keys from the detached latents: the index keys train the indexer only (by its KL)
    k = ctx.norm(nx.bf16_gemm(latents.detach(), w[f"{p}.indexer.wk.weight"]), f"{p}.indexer.k_norm.weight")
    keys = tq.fake_fp4_index(nx.apply_rope(k, rot)).unflatten(0, (b, groups))  # [B, G, Di]
    entries = tq.fake_fp4_kv(nx.apply_rope(latents, rot)).unflatten(0, (b, groups))  # [B, G, D]
    ctx.sources[layer] = (entries, keys)


def cfg_ratio(cfg, layer: int) -> int:
    return cfg.compress_ratios[layer] if layer < cfg.num_layers else 0


def _select(ctx: Ctx, layer: int, x: torch.Tensor, qr: torch.Tensor, rot: torch.Tensor) -> None:
    """An index source's top-k per sequence (the engine's rule), recorded for the KL."""
    cfg, w, v = ctx.cfg, ctx.w, ctx.cfg.v41
    p, ratio, L = f"layers.{layer}.attn.indexer", cfg_ratio(cfg, layer), ctx.length
    n = L // ratio
    visible = (torch.arange(L, device=ctx.device) + 1) // ratio  # [L]
    # queries and head weights from detached inputs: only the indexer's own tensors learn here
    iq = ctx.gemm(qr.detach(), f"{p}.wq_b.weight").unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
    iq = tq.fake_fp4_index(nx.apply_rope(iq, rot))  # [N, Hi, Di]
    weights = nx.bf16_gemm(x.detach(), w[f"{p}.weights_proj.weight"]) * (
        cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)  # [N, Hi] bf16
    keys = ctx.sources[cfg.v41.kv_source_of(layer)][1]
    record = IndexRecord([], [])
    topk, cands = [], []
    for b in range(ctx.batch):
        rows = slice(b * L, (b + 1) * L)
        dots = torch.einsum("thd,nd->thn", iq[rows].float(), keys[b, :n].float()).to(torch.bfloat16)  # [L, Hi, n]
        scores = (dots.relu() * weights[rows, :, None]).sum(dim=1)  # [L, n] bf16
        scores = scores.masked_fill(torch.arange(n, device=ctx.device) >= visible[:, None], float("-inf"))
        pick = scores.detach()
        if layer == v.candidate_source_layer:
            cands.append(candidate_blocks(pick, visible, v.candidate_topk_blocks, v.candidate_block_size))
        elif 0 <= v.candidate_source_layer < layer:  # level two: only inside the candidate blocks
            pick = pick.masked_fill(~ctx.handoff["candidates"][b], float("-inf"))
            scores = scores.masked_fill(~ctx.handoff["candidates"][b], float("-inf"))
        idx = nx.top_indices(pick, min(cfg.index_topk, n)).sort(dim=-1).values
        chosen = torch.where(idx < visible[:, None], idx, -1)
        topk.append(chosen)
        record.scores.append(scores)
        record.chosen.append(chosen)
    if cands:
        ctx.handoff["candidates"] = cands
    ctx.handoff["topk"] = topk
    ctx.index[layer] = record


def _entry_mass(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
                first_entry: int) -> torch.Tensor:
    """Attention probability (summed over heads) of each column from `first_entry` on. [N, k]"""
    with torch.no_grad():
        valid = idx >= 0
        keys = kv[idx.clamp_min(0)].float()  # [N, K, D]
        s = (torch.einsum("thd,tkd->thk", q.float(), keys) * scale).masked_fill(~valid[:, None, :], float("-inf"))
        top = torch.maximum(s.amax(-1), sink.float()[None, :])  # [N, H]
        p = torch.exp(s - top[..., None])
        prob = p / (p.sum(-1) + torch.exp(sink.float()[None, :] - top))[..., None]
        return prob[..., first_entry:].sum(dim=1)


# ---- attention of a backbone layer ------------------------------------------------------------


def attention(ctx: Ctx, layer: int, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x [N, dim] (B sequences of L rows from position 0) → [N, dim]."""
    cfg, w = ctx.cfg, ctx.w
    p, ratio, b, L = f"layers.{layer}.attn", cfg_ratio(cfg, layer), ctx.batch, ctx.length
    qr, q = project_q(ctx, p, x, rot)
    win = window_rows(ctx, p, x, rot)  # [N, D]
    base = window_index(torch.arange(L, device=ctx.device), 0, cfg.sliding_window)  # [L, W] one sequence's rows, −1 none
    offsets = (torch.arange(b, device=ctx.device) * L).repeat_interleave(L)[:, None]  # [N, 1]
    idx = torch.where(base.repeat(b, 1) >= 0, base.repeat(b, 1) + offsets, -1)
    kv = win
    if ratio:
        if layer in cfg.v41.kv_source_layers:
            _publish(ctx, layer, x)
        if layer in cfg.v41.index_source_layers:
            _select(ctx, layer, x, qr, rot)
        entries = ctx.sources[cfg.v41.kv_source_of(layer)][0]  # [B, G, D]
        n = L // ratio
        chosen = torch.cat(ctx.handoff["topk"])  # [N, k]
        entry_off = (b * L + torch.arange(b, device=ctx.device) * n).repeat_interleave(L)[:, None]
        kv = torch.cat([win, entries[:, :n].reshape(b * n, -1)])
        idx = torch.cat([idx, torch.where(chosen >= 0, chosen + entry_off, -1)], dim=-1)
        if layer in ctx.index:
            mass = _entry_mass(q, kv, idx, w[f"{p}.attn_sink"], cfg.head_dim**-0.5, base.shape[1])
            ctx.index[layer].mass = list(mass.unflatten(0, (b, L)))
    o = nx.sparse_attention(q, kv, idx, w[f"{p}.attn_sink"], cfg.head_dim**-0.5)
    return output(ctx, p, o, rot)


# ---- the backbone -------------------------------------------------------------------------------


@dataclass
class MainOut:
    logits: torch.Tensor  # [B, L, V] fp32
    main_hidden: torch.Tensor | None  # [B, L, n_targets·dim] bf16: DSpark's observation
    ctx: Ctx


def engram_hashes(hasher: EngramHasher, ids: torch.Tensor) -> torch.Tensor:
    """[B, L] token ids from position 0 → int64 [B·L, n_engram_layers, cols] on ids' device
    (hashed on the host, as the engine hashes)."""
    with torch.device("cpu"):  # the hasher's tables are host tensors
        back = torch.full((hasher.lookback,), hasher.pad, dtype=torch.int64)
        hashes = torch.cat([hasher.hash_ids(back, hasher.compress(row)) for row in ids.cpu()])
    return hashes.to(ids.device)


def engram(ctx: Ctx, p: str, stream: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
    """Gated per-stream update from hashed n-gram rows (engine/v41/model.py `Engram`)."""
    cfg, w = ctx.cfg, ctx.w
    n, d = cfg.hc_mult, cfg.hidden_size
    rows = w[f"{p}.embed.weight"].to(torch.bfloat16)[hash_ids]  # [N, cols, head_dim]
    kv = ctx.gemm(rows.flatten(1), f"{p}.wkv.weight")  # [N, (hc + 1)·dim] bf16
    key, value = kv.split([n * d, d], dim=-1)
    key = key.float().unflatten(-1, (n, d))
    weight = w[f"{p}.q_weight"].to(torch.bfloat16).float() * w[f"{p}.k_weight"].to(torch.bfloat16).float()
    h, eps = stream.float(), cfg.rms_norm_eps
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)  # [N, hc]
    dot = (h * weight * key).sum(-1) * rstd * d**-0.5
    gate = nx.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (h + gate[..., None] * value.float()[:, None, :]).to(torch.bfloat16)


def forward(cfg, w: dict[str, torch.Tensor], hasher: EngramHasher | None, ids: torch.Tensor,
            exact: bool = True) -> MainOut:
    """ids [B, L] (each a sequence from position 0) → logits and DSpark's observation, on the
    masters' device."""
    v, (b, L) = cfg.v41, ids.shape
    ids = ids.to(w["embed.weight"].device)
    ctx = new_ctx(cfg, w, b, L, exact)
    hashes = engram_hashes(hasher, ids) if v.engram_layer_ids else None
    positions = torch.arange(L, device=ids.device).repeat(b)
    stream = w["embed.weight"].to(torch.bfloat16)[ids.flatten()][:, None, :].repeat(1, cfg.hc_mult, 1)
    pre_mix = identity_pre(b * L, cfg.hc_mult, ids.device)
    targets = {}
    for i in range(cfg.num_layers):
        if i in v.engram_layer_ids:
            stream = engram(ctx, f"layers.{i}.engram", stream, hashes[:, v.engram_layer_ids.index(i)])
        if i in v.dspark_target_layer_ids:  # DSpark reads the attention input
            targets[i] = stream.mean(dim=1)
        rot = nx.rotation(positions, ctx.freqs_compress if cfg_ratio(cfg, i) else ctx.freqs_main)
        stream, pre_mix = block(ctx, f"layers.{i}", stream, pre_mix,
                                lambda x, i=i, rot=rot: attention(ctx, i, x, rot), cfg.num_experts_per_tok)
    x = ctx.norm(nx.hc_collapse(stream, pre_mix), "norm.weight")
    logits = nx.fp32_gemm(x, w["head.weight"]).unflatten(0, (b, L))
    main = torch.cat([targets[t] for t in v.dspark_target_layer_ids], dim=-1).unflatten(0, (b, L)) if targets else None
    return MainOut(logits, main, ctx)


def indexer_kl(record: IndexRecord) -> torch.Tensor:
    """Mean over queries with a selection of KL(main attention's head-summed mass over the
    selected entries, renormalised ‖ softmax of the index scores over them)."""
    terms = []
    for scores, chosen, mass in zip(record.scores, record.chosen, record.mass):
        valid = chosen >= 0  # [L, k]
        target = mass.masked_fill(~valid, 0.0)
        rows = valid.any(-1) & (target.sum(-1) > 0)
        if not rows.any():
            continue
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
        picked = scores.float().gather(-1, chosen.clamp_min(0)).masked_fill(~valid, float("-inf"))
        log_q = torch.log_softmax(picked, dim=-1)
        kl = torch.where(valid & (target > 0), target * (target.clamp_min(1e-30).log() - log_q), 0.0)
        terms.append(kl.sum(-1)[rows])
    if not terms:
        return torch.zeros((), device=record.scores[0].device)
    return torch.cat(terms).mean()
