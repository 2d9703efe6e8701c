"""DSpark, V4.1's block drafter: three window-only stages (`mtp.0..2`) sharing the backbone's
embed and head.

Observation: the main model's hc-mean attention inputs of the target layers, concatenated, give
main_x = main_norm(main_proj(·)) (stage 0's weights); every stage keeps its own `window` rows of
fake-FP8 RoPE(kv_norm(wkv(main_x))) at the main positions — per-request state, stored as layers
num_layers + s of the window pool, written by position (so it follows chunked prefill,
recompute and rollback like every other row).

Drafting after position p (the last main position observed) with anchor a (the token at p + 1):
[a, noise × (block − 1)] at positions p + 1..p + block runs through the stages (mHC blocks with
delayed pre; every block query sees every window row and every block row, no causal mask
inside the block), collapses with the last FFN pre, and decodes greedily with the Markov head:
draft_{i+1} = argmax(head(norm(x_i)) + markov_head(draft_i)), draft_0 = a. The confidence head
reads [x_i before the norm, markov_embed(draft_i)].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import numerics as nx
from .attention import Chunk
from .linear import Param, QLinear
from .model import Block, V41Model, identity_pre


class DSparkStage(Block):
    def __init__(self, cfg, stage: int):
        v = cfg.v41
        super().__init__(cfg, cfg.num_layers + stage, v.dspark_n_routed_experts, v.dspark_n_activated_experts)
        d, last = cfg.hidden_size, stage == cfg.num_nextn_predict_layers - 1
        if stage == 0:
            self.main_proj = QLinear(len(v.dspark_target_layer_ids) * d, d)
            self.main_norm = Param(d)
        if last:
            self.norm = Param(d)
            self.markov_head = nn.Module()
            self.markov_head.embed = Param(cfg.vocab_size, v.dspark_markov_rank)
            self.markov_head.head = Param(cfg.vocab_size, v.dspark_markov_rank, dtype=torch.float32)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = Param(1, d + v.dspark_markov_rank, dtype=torch.float32)


@dataclass
class Draft:
    tokens: list[int]  # block_size greedy drafts after the anchor
    confidence: torch.Tensor  # fp32 [block_size]
    logits: torch.Tensor  # fp32 [block_size, V], Markov bias included


class DSpark:
    def __init__(self, model: V41Model):
        self.model, self.cfg = model, model.cfg
        self.stages = list(model.mtp)

    def observe(self, main_hidden: torch.Tensor, chunks: list[Chunk]) -> None:
        """Write every stage's window rows for the chunks' positions (rows of main_hidden)."""
        if not self.stages or main_hidden is None or not main_hidden.shape[0]:
            return
        with nx.numerics(self.model.numerics):
            cfg, s0 = self.cfg, self.stages[0]
            main_x = nx.rms_norm(s0.main_proj(main_hidden), s0.main_norm.weight, cfg.rms_norm_eps)  # [T, dim]
            positions = torch.cat([torch.arange(c.start, c.end, device=main_x.device) for c in chunks])
            rot = nx.rotation(positions, self.model.freqs_main)
            for stage in self.stages:
                rows = stage.attn.window_rows(main_x, rot)
                for c in chunks:
                    c.seq.window(stage.layer).write(c.start, rows[c.rows])

    def draft(self, seq, anchor: int, position: int) -> Draft:
        with nx.numerics(self.model.numerics):
            return self._draft(seq, anchor, position)

    def _attend(self, stage: DSparkStage, x: torch.Tensor, position: int, seq) -> torch.Tensor:
        cfg, attn = self.cfg, stage.attn
        w = cfg.sliding_window
        rot = nx.rotation(torch.arange(position + 1, position + 1 + x.shape[0], device=x.device), self.model.freqs_main)
        _, q = attn.project_q(x, rot)
        lo = max(0, position - w + 1)
        window = seq.window(stage.layer).read(lo, position + 1)  # main KV of positions lo..position
        if window.shape[0] == w:  # REF reads its full ring in slot order (slot = position mod window)
            window = window.roll((position + 1) % w, dims=0)
        from .quant import fake_fp8

        kv = torch.cat([window, fake_fp8(attn.window_rows(x, rot))])
        idx = torch.arange(kv.shape[0], device=x.device).expand(x.shape[0], -1)
        o = nx.sparse_attention(q, kv, idx, attn.attn_sink, cfg.head_dim**-0.5)
        return attn.output(o, rot)

    def _draft(self, seq, anchor: int, position: int) -> Draft:
        cfg, v, model = self.cfg, self.cfg.v41, self.model
        block = v.dspark_block_size
        ids = torch.tensor([anchor] + [v.dspark_noise_token_id] * (block - 1), device=model.device)
        stream = model.embed.weight[ids][:, None, :].repeat(1, cfg.hc_mult, 1)  # [block, hc, dim]
        pre_mix = identity_pre(block, cfg.hc_mult, model.device)
        chunks = [Chunk(seq, position + 1, 0, block)]
        for stage in self.stages:
            def attend(x, stage=stage):
                return self._attend(stage, x, position, seq)
            stream, pre_mix = stage(stream, pre_mix, attend, chunks)
        last = self.stages[-1]
        x = nx.hc_collapse(stream, pre_mix)  # [block, dim] bf16
        logits = nx.fp32_gemm(nx.rms_norm(x, last.norm.weight, cfg.rms_norm_eps), model.head.weight)  # [block, V]
        # The chain stays on the device: one read of the drafts at the end, not one per draft.
        tokens, embeds = [torch.tensor(anchor, device=model.device)], []
        for i in range(block):
            # [rank] bf16; index_select, not a 0-dim tensor index (that reads the index back)
            embed = last.markov_head.embed.weight.index_select(0, tokens[-1].view(1))[0]
            logits[i] += nx.fp32_gemm(embed[None], last.markov_head.head.weight)[0]
            embeds.append(embed)
            tokens.append(logits[i].argmax())
        hidden = torch.cat([x, torch.stack(embeds)], dim=-1)  # [block, dim + rank]
        confidence = nx.fp32_gemm(hidden, last.confidence_head.proj.weight)[:, 0]
        return Draft(torch.stack(tokens[1:]).cpu().tolist(), confidence, logits)
