"""The V4 multi-token-prediction (MTP) layer, used as the speculative draft head.

Row at position p combines the target model's final residual streams after token t_p (pre hc
head) with the embedding of token t_{p+1} (zeroed at position 0, as vLLM does) and predicts
t_{p+2}:
    h = h_proj(hnorm(H_p)) + e_proj(enorm(emb(t_{p+1})))      broadcast over the n streams
    H' = Block_swa(h)                                           its own 128-token window
    logits = head(norm(hc_head(H')))                            head shared with the model
For nextn = k the same layer is applied k times, each time fed its own output streams and
its own draft token at the next position.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels

from ..config import ModelConfig
from ..linear import Linear
from .layers import rms_norm
from .model import Block, DeepseekV4, HyperHead


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.layer_id = cfg.num_layers + index  # its pools' layer number in the KV layout
        d = cfg.hidden_size
        self.enorm = nn.Parameter(torch.empty(d))
        self.hnorm = nn.Parameter(torch.empty(d))
        self.e_proj = Linear(d, d)  # FP8 in the release
        self.h_proj = Linear(d, d)
        self.block = Block(cfg, "swa", 0, hash_routing=False)
        self.hc_head = HyperHead(cfg)
        self.norm = nn.Parameter(torch.empty(d))

    def forward(self, model: DeepseekV4, streams: torch.Tensor, next_token_ids: torch.Tensor,
                positions: torch.Tensor, ctx) -> torch.Tensor:
        """streams: [T, n, D] target streams at `positions`; next_token_ids: [T]. Returns [T, n, D].
        `ctx` is an attention context over the same sequences; this layer's KV is its `layer_id`."""
        eps = self.cfg.rms_norm_eps
        emb = model.embed[next_token_ids]
        emb = torch.where((positions == 0)[:, None], torch.zeros_like(emb), emb)
        h = self.h_proj(rms_norm(streams, self.hnorm, eps))  # [T, n, D]
        h = h + self.e_proj(rms_norm(emb, self.enorm, eps)).unsqueeze(1)
        return self.block(h, next_token_ids, positions, model.step_rope(positions), ctx, self.layer_id)

    def logits(self, model: DeepseekV4, streams: torch.Tensor) -> torch.Tensor:
        x = rms_norm(self.hc_head(streams, self.cfg), self.norm, self.cfg.rms_norm_eps)
        return kernels.dense_linear(x, model.head).float()
