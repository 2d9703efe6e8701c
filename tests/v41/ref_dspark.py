"""DSpark block drafting of DeepSeek-V4.1 (REF `DSparkBlock` / `forward_spec`), for one sequence.

Three window-only stages (`mtp.0..2`, sharing the backbone's embed and head). The main model's
hc-mean attention inputs of the target layers, concatenated, become main_x =
main_norm(main_proj(·)) (stage 0's weights); every stage keeps its own `window` rows of
kv_norm(wkv(main_x)) KV (RoPE at the main positions, fake FP8) — `observe` appends them after
each main forward. A draft at position p feeds [anchor, noise × (block − 1)] at positions
p+1..p+block through the stages (mHC blocks with delayed pre, each block query seeing every
window row and every block row — no causal mask inside the block), collapses with the last
FFN pre, and decodes greedily with the Markov head: draft i+1 = argmax(head(norm(x_i)) +
markov_head(draft_i)), draft_0 = anchor. The confidence head reads [x_i (pre-norm), markov_embed_i].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ref_attention import attend_window, layer_freqs, output_projection, project_q, window_entries
from .ref_ops import (fp32_linear, hc_collapse, quantized_linear, rms_norm, rope_rotation, row_independent_numerics,
                      sparse_attention)
from .ref_state import SequenceState
from .reference_model import ReferenceV41, block, identity_pre


@dataclass
class Draft:
    tokens: list[int]  # block_size greedy draft ids (the anchor excluded)
    confidence: torch.Tensor  # fp32 [block_size]
    logits: torch.Tensor  # fp32 [block_size, V], Markov bias included


class DSpark:
    def __init__(self, model: ReferenceV41):
        self.model, self.cfg, self.w = model, model.cfg, model.w
        self.stages = [f"mtp.{s}" for s in range(self.cfg.n_mtp_layers)]

    def _layer(self, stage: int) -> int:
        return self.cfg.n_layers + stage  # index into compress_ratios (always 0: main rope)

    def observe(self, state: SequenceState, main_hidden: torch.Tensor, pos0: int) -> None:
        """Append each stage's window KV for the main positions [pos0, pos0 + T)."""
        with row_independent_numerics(self.model.opts.row_independent):
            self._observe(state, main_hidden, pos0)

    def _observe(self, state: SequenceState, main_hidden: torch.Tensor, pos0: int) -> None:
        cfg, w = self.cfg, self.w
        main_x = rms_norm(quantized_linear(main_hidden, w["mtp.0.main_proj.weight"]), w["mtp.0.main_norm.weight"],
                          cfg.norm_eps)  # [T, dim]
        positions = torch.arange(pos0, pos0 + main_x.shape[0])
        for s, p in enumerate(self.stages):
            rot = rope_rotation(positions, layer_freqs(cfg, self._layer(s)))
            attend_window(state.dspark_kv, s, window_entries(w, f"{p}.attn", cfg, main_x, rot), pos0, cfg.window)

    def _attend(self, stage: int, x: torch.Tensor, position: int, state: SequenceState) -> torch.Tensor:
        """Block attention of one stage: x [block, dim] at positions position+1.. → [block, dim]."""
        cfg, w, p = self.cfg, self.w, f"{self.stages[stage]}.attn"
        rot = rope_rotation(torch.arange(position + 1, position + 1 + x.shape[0]), layer_freqs(cfg, self._layer(stage)))
        _, q = project_q(w, p, cfg, x, rot)
        window = state.dspark_kv[stage]  # main KV of positions position-n+1..position, n ≤ window
        if window.shape[0] == cfg.window:  # REF reads its full ring in slot order (slot = pos % window)
            window = window.roll((position + 1) % cfg.window, dims=0)
        kv = torch.cat([window, window_entries(w, p, cfg, x, rot)])
        idx = torch.arange(kv.shape[0]).expand(x.shape[0], -1)  # every row, for every block query
        o = sparse_attention(q, kv, idx, w[f"{p}.attn_sink"], cfg.head_dim**-0.5)
        return output_projection(w, p, cfg, o, rot)

    def draft(self, state: SequenceState, anchor: int, position: int) -> Draft:
        """Draft the block after `anchor`, the token at position + 1 (position = the last main
        position already observed)."""
        with row_independent_numerics(self.model.opts.row_independent):
            return self._draft(state, anchor, position)

    def _draft(self, state: SequenceState, anchor: int, position: int) -> Draft:
        cfg, w, block_size = self.cfg, self.w, self.cfg.dspark_block_size
        ids = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (block_size - 1))
        stream = w["embed.weight"][ids][:, None, :].repeat(1, cfg.hc_mult, 1)  # [block, hc, dim]
        pre_mix = identity_pre(block_size, cfg.hc_mult)
        for s, p in enumerate(self.stages):
            def attend(x, s=s):
                return self._attend(s, x, position, state)
            stream, pre_mix = block(w, p, cfg, stream, pre_mix, attend, cfg.dspark_n_routed_experts,
                                    cfg.dspark_n_activated_experts)
        last = self.stages[-1]
        x = hc_collapse(stream, pre_mix)  # [block, dim] bf16
        logits = fp32_linear(rms_norm(x, w[f"{last}.norm.weight"], cfg.norm_eps), w["head.weight"])  # [block, V]
        tokens, embeds = [anchor], []
        for i in range(block_size):
            embed = w[f"{last}.markov_head.embed.weight"][tokens[-1]]  # [rank] bf16
            logits[i] += fp32_linear(embed[None], w[f"{last}.markov_head.head.weight"])[0]
            embeds.append(embed)
            tokens.append(int(logits[i].argmax()))
        hidden = torch.cat([x, torch.stack(embeds)], dim=-1)  # [block, dim + rank]
        confidence = fp32_linear(hidden, w[f"{last}.confidence_head.proj.weight"])[:, 0]
        return Draft(tokens[1:], confidence, logits)

