"""DSpark in static shapes (engine/v41/dspark.py): observing a static step's rows and drafting a
block after each sequence's newest token, on the device, from the step's device results.

Observation writes every stage's window rows for the step's B·q positions (rows past a
sequence's accepted tokens are rewritten before anything reads them, as in the eager path).
Drafting takes, per sequence, the number of drafts the verification accepted (a) and the token
it emitted after them (the anchor): the last accepted position is p = start + a, and the block
[anchor, noise × (block − 1)] at positions p + 1..p + block runs through the stages, reading the
window rows of positions p − window + 1..p in REF's slot order (the row of position P in column
P mod window; columns before the sequence start masked), then decodes greedily with the Markov
head: one argmax per draft, on the device. Nothing is read back here; the step's one read
carries the drafts.
"""

from __future__ import annotations

import torch

from . import numerics as nx
from .model import identity_pre, per_chunk
from .quant import fake_fp8
from .static_forward import StepContext, attend_rows, row_groups
from .static_moe import static_moe


def observe(model, main_hidden: torch.Tensor, ctx: StepContext) -> None:
    """Write every stage's window rows at the step's positions; main_hidden [N, n_targets·dim]."""
    cfg, stages, batch = model.cfg, list(model.mtp), ctx.batch
    s0 = stages[0]
    main_x = nx.rms_norm(s0.main_proj(main_hidden), s0.main_norm.weight, cfg.rms_norm_eps)  # [N, dim]
    slots, _ = batch.sliding_slots(batch.positions.view(*ctx.shape))
    for stage in stages:
        pool, layer = ctx.pool("swa", stage.layer)
        pool.write(layer, slots.reshape(-1), stage.attn.window_rows(main_x, ctx.rot_main))


def draft(model, ctx: StepContext, accepted: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """Greedy drafts [B, block] int64 after position start + accepted[b] with anchor[b] ([B] each)."""
    cfg, v, batch = model.cfg, model.cfg.v41, ctx.batch
    stages, device = list(model.mtp), anchor.device
    b, block, w = batch.num_seqs, v.dspark_block_size, cfg.sliding_window
    last = batch.start + accepted  # [B] the last accepted main position
    noise = torch.full((b, block - 1), v.dspark_noise_token_id, dtype=torch.long, device=device)
    ids = torch.cat([anchor[:, None], noise], dim=1).reshape(-1)  # [B·block]
    positions = (last[:, None] + 1 + torch.arange(block, device=device)).reshape(-1)
    rot = nx.rotation(positions, model.freqs_main)
    column = torch.arange(w, device=device)
    window_pos = last[:, None] - (last[:, None] - column).remainder(w)  # [B, W]: column P mod W holds P
    window_slots, window_valid = batch.sliding_slots(window_pos)
    groups = row_groups(b, block, device)

    stream = model.embed.weight[ids][:, None, :].repeat(1, cfg.hc_mult, 1)  # [B·block, hc, dim]
    pre_mix = identity_pre(b * block, cfg.hc_mult, device)
    for stage in stages:
        pool, layer = ctx.pool("swa", stage.layer)
        window = pool.read(layer, window_slots.reshape(-1), ctx.cache.dtype).view(b, w, -1)

        def attend(x, stage=stage, window=window):
            return _attend_block(stage.attn, x, rot, window, window_valid, groups, block)

        stream, pre_mix = stage(stream, pre_mix, attend, groups, ffn=lambda x, s=stage: static_moe(s.ffn, x, groups))
    head = stages[-1]
    x = nx.hc_collapse(stream, pre_mix)  # [B·block, dim] bf16
    normed = nx.rms_norm(x, head.norm.weight, cfg.rms_norm_eps)
    logits = per_chunk(lambda r: nx.fp32_gemm(r, model.head.weight), groups, normed).view(b, block, -1)
    one_row = row_groups(b, 1, device)
    tokens = [anchor]
    for i in range(block):  # draft_{i+1} = argmax(logits_i + markov_head(draft_i))
        embed = head.markov_head.embed.weight[tokens[-1]]  # [B, rank] bf16
        logits[:, i] += per_chunk(lambda e: nx.fp32_gemm(e, head.markov_head.head.weight), one_row, embed)
        tokens.append(logits[:, i].argmax(dim=-1))
    return torch.stack(tokens[1:], dim=1)


def _attend_block(attn, x: torch.Tensor, rot: torch.Tensor, window: torch.Tensor, window_valid: torch.Tensor,
                  groups, block: int) -> torch.Tensor:
    """A stage's attention for the B blocks: every block query sees its sequence's window rows
    and all its block's rows (no causal mask inside the block). x [B·block, dim] → same."""
    b, w, _ = window.shape
    _, q = attn.project_q(x, rot)
    rows = fake_fp8(attn.window_rows(x, rot)).view(b, block, -1)
    keys = torch.cat([window, rows], dim=1)  # [B, W + block, D]
    valid = torch.cat([window_valid, torch.ones(b, block, dtype=torch.bool, device=x.device)], dim=1)
    keys = keys[:, None].expand(b, block, *keys.shape[1:]).reshape(b * block, *keys.shape[1:])
    valid = valid[:, None].expand(b, block, valid.shape[1]).reshape(b * block, -1)
    o = per_chunk(lambda q_, k_, v_: attend_rows(attn, q_, k_, v_), groups, q, keys, valid)
    return attn.output(o, rot)
