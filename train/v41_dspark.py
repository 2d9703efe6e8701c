"""DSpark, V4.1's block drafter, trained as engine/v41/dspark.py drafts.

Inference (engine/v41/dspark.py): after main position p, with anchor a = the token at p + 1,
[a, noise × (block − 1)] at positions p + 1..p + block runs through the stages; each stage's
queries see its window rows of the main positions max(0, p − window + 1)..p (fake-FP8
RoPE(kv_norm(wkv(main_x))), main_x = main_norm(main_proj(main_hidden))) and every block row (no
causal mask inside the block); block row i then gives head(norm(x_i)) + markov_head(draft_i)
for draft_{i+1}, draft_0 = a.

Training runs the same computation for many anchors of each window at once. Block row i of the
anchor at p + 1 is trained to predict token t_{p+2+i} (i = 0..block − 1: the targets
t_{p+2..p+block+1}), its Markov term reading the true previous token t_{p+1+i} (teacher forcing:
at inference the previous draft, equal to it whenever the drafts so far were right, the only
case in which row i's draft can be accepted). The confidence head learns, by binary cross
entropy on detached inputs, whether row i's argmax is right. The observation (main_hidden) is
detached: the drafter learns on the main model's features without changing them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.v41 import numerics as nx
from engine.v41.model import identity_pre

from .v41_model import Ctx, block, new_ctx, output, project_q, window_rows


def observe(ctx: Ctx, main_hidden: torch.Tensor) -> list[torch.Tensor]:
    """main_hidden [B, L, n_targets·dim] → per stage its window rows [B·L, dim] at positions 0..L−1."""
    b, L = main_hidden.shape[:2]
    main_x = ctx.norm(ctx.gemm(main_hidden.flatten(0, 1), "mtp.0.main_proj.weight"), "mtp.0.main_norm.weight")
    rot = nx.rotation(torch.arange(L, device=ctx.device).repeat(b), ctx.freqs_main)
    return [window_rows(ctx, f"mtp.{s}.attn", main_x, rot) for s in range(ctx.cfg.num_nextn_predict_layers)]


def _window_slots(p: torch.Tensor, window: int) -> torch.Tensor:
    """[A, window] main positions each anchor's block reads, as the engine lays them out: a full
    window in ring-slot order (slot = position mod window), a partial one ascending; −1 pads."""
    j = torch.arange(window, device=p.device)
    full = p[:, None] - window + 1 + (j[None, :] - (p[:, None] + 1)) % window  # slot order
    partial = torch.where(j[None, :] <= p[:, None], j[None, :], -1)
    return torch.where((p >= window - 1)[:, None], full, partial)


@dataclass
class BlockOut:
    x: torch.Tensor  # [A, block, dim] bf16: the collapsed stream (pre-norm)
    logits: torch.Tensor  # [A, block, V] fp32 without the Markov term


def run_blocks(ctx: Ctx, rows: list[torch.Tensor], seq: torch.Tensor, p: torch.Tensor, anchors: torch.Tensor,
               ) -> BlockOut:
    """Blocks of anchors: sequence seq [A], last observed position p [A], anchor ids [A]."""
    cfg, v, w = ctx.cfg, ctx.cfg.v41, ctx.w
    a, block_n, win = anchors.shape[0], v.dspark_block_size, cfg.sliding_window
    noise = torch.full((a, block_n - 1), v.dspark_noise_token_id, device=anchors.device)
    ids = torch.cat([anchors[:, None], noise], dim=1)  # [A, block]
    positions = (p[:, None] + 1 + torch.arange(block_n, device=p.device)).flatten()  # [A·block]
    rot = nx.rotation(positions, ctx.freqs_main)
    slots = _window_slots(p, win)  # [A, window]
    main_rows = torch.where(slots >= 0, seq[:, None] * ctx.length + slots, -1)
    n_window = int((slots >= 0).sum(-1).max())

    def attend(x: torch.Tensor, s: int) -> torch.Tensor:
        att = f"mtp.{s}.attn"
        _, q = project_q(ctx, att, x, rot)
        own = window_rows(ctx, att, x, rot)  # [A·block, D]
        kv = torch.cat([rows[s], own])
        block_idx = rows[s].shape[0] + torch.arange(a * block_n, device=p.device).view(a, block_n)  # [A, block]
        # the engine's column order: window rows, then the block rows (padding last)
        cols = torch.cat([main_rows[:, :n_window], block_idx], dim=-1)
        order = torch.sort((cols < 0).to(torch.int8), dim=-1, stable=True).indices  # valid first, in place
        cols = cols.gather(-1, order)
        idx = cols.repeat_interleave(block_n, dim=0)  # [A·block, K]
        o = nx.sparse_attention(q, kv, idx, w[f"{att}.attn_sink"], cfg.head_dim**-0.5)
        return output(ctx, att, o, rot)

    stream = w["embed.weight"].to(torch.bfloat16)[ids.flatten()][:, None, :].repeat(1, cfg.hc_mult, 1)
    pre_mix = identity_pre(a * block_n, cfg.hc_mult, anchors.device)
    for s in range(cfg.num_nextn_predict_layers):
        stream, pre_mix = block(ctx, f"mtp.{s}", stream, pre_mix, lambda x, s=s: attend(x, s),
                                v.dspark_n_activated_experts)
    last = f"mtp.{cfg.num_nextn_predict_layers - 1}"
    x = nx.hc_collapse(stream, pre_mix)  # [A·block, dim] bf16
    logits = nx.fp32_gemm(ctx.norm(x, f"{last}.norm.weight"), w["head.weight"])
    return BlockOut(x.unflatten(0, (a, block_n)), logits.unflatten(0, (a, block_n)))


def markov(ctx: Ctx, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """prev token ids [...] → (Markov logits [..., V] fp32, its bf16 embeddings [..., rank])."""
    last = f"mtp.{ctx.cfg.num_nextn_predict_layers - 1}"
    embed = ctx.w[f"{last}.markov_head.embed.weight"].to(torch.bfloat16)[prev]
    flat = nx.fp32_gemm(embed.reshape(-1, embed.shape[-1]), ctx.w[f"{last}.markov_head.head.weight"])
    return flat.reshape(*prev.shape, -1), embed


def confidence(ctx: Ctx, x: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """[..., dim] bf16 and [..., rank] bf16 → fp32 confidence logits [...]."""
    last = f"mtp.{ctx.cfg.num_nextn_predict_layers - 1}"
    hidden = torch.cat([x, embed], dim=-1)
    flat = nx.fp32_gemm(hidden.reshape(-1, hidden.shape[-1]), ctx.w[f"{last}.confidence_head.proj.weight"])
    return flat[:, 0].reshape(hidden.shape[:-1])


@dataclass
class DSparkLosses:
    ce: torch.Tensor  # mean next-token cross entropy over every block row
    confidence: torch.Tensor  # BCE of the confidence head
    per_position: torch.Tensor  # [block] teacher-forced argmax accuracy per block row (no grad)


def anchor_positions(length: int, block: int, count: int, batch: int, gen: torch.Generator | None,
                     device: torch.device | str = "cpu"):
    """(sequence [A], p [A]) with p in [0, length − block − 1] (targets inside the window):
    every p when count is 0 or covers them, else `count` per sequence drawn by `gen` (a host
    generator: the draw is the same whatever the device), on `device`."""
    span = length - block
    if span < 1:
        raise ValueError(f"windows of {length} tokens leave no DSpark anchor for blocks of {block}")
    with torch.device("cpu"):
        if count <= 0 or count >= span:
            p = torch.arange(span).repeat(batch)
        else:
            p = torch.cat([torch.randperm(span, generator=gen)[:count].sort().values for _ in range(batch)])
        seq = torch.arange(batch).repeat_interleave(p.shape[0] // batch)
    return seq.to(device), p.to(device)


def losses(ctx: Ctx, main_hidden: torch.Tensor, window: torch.Tensor, count: int,
           gen: torch.Generator | None = None) -> DSparkLosses:
    """window [B, L+1] token ids (inputs window[:, :L], whose main_hidden this is)."""
    v, b, L = ctx.cfg.v41, window.shape[0], window.shape[1] - 1
    block_n = v.dspark_block_size
    rows = observe(ctx, main_hidden.detach())
    seq, p = anchor_positions(L, block_n, count, b, gen, window.device)
    out = run_blocks(ctx, rows, seq, p, window[seq, p + 1])
    offsets = p[:, None] + 1 + torch.arange(block_n, device=p.device)  # [A, block] positions of the previous tokens
    prev, target = window[seq[:, None], offsets], window[seq[:, None], offsets + 1]
    bias, embed = markov(ctx, prev)
    logits = out.logits + bias  # [A, block, V]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    right = (logits.detach().argmax(-1) == target).float()  # [A, block]
    conf = confidence(ctx, out.x.detach(), embed.detach())
    bce = F.binary_cross_entropy_with_logits(conf, right)
    return DSparkLosses(ce, bce, right.mean(0))


@torch.no_grad()
def greedy_draft(cfg, w: dict[str, torch.Tensor], main_hidden: torch.Tensor, anchor: int, exact: bool = True):
    """The engine's draft after the last of main_hidden's positions [1, p+1, ·]: (block tokens, confidence [block])."""
    L = main_hidden.shape[1]
    ctx = new_ctx(cfg, w, 1, L, exact)
    rows = observe(ctx, main_hidden)
    dev = ctx.device
    out = run_blocks(ctx, rows, torch.zeros(1, dtype=torch.long, device=dev), torch.tensor([L - 1], device=dev),
                     torch.tensor([anchor], device=dev))
    tokens, embeds = [anchor], []
    for i in range(cfg.v41.dspark_block_size):
        bias, embed = markov(ctx, torch.tensor([tokens[-1]], device=dev))
        embeds.append(embed[0])
        tokens.append(int((out.logits[0, i] + bias[0]).argmax()))
    conf = confidence(ctx, out.x[0], torch.stack(embeds))
    return tokens[1:], conf
