"""The DeepSeek-V4 transformer: embedding → n mHC residual streams → blocks → hc head → logits.

`forward` takes a step's tokens for many sequences flattened without padding, each sequence
with its own absolute positions and `SequenceState`. Chunked prefill, decode and multi-token
verification are the same call; state is read and written by position (see seq_state.py).
"""

from __future__ import annotations

import torch
from torch import nn

import kernels

from ..config import ModelConfig
from .attention import Attention, StepRope
from .layers import RotaryTable, hc_collapse, hc_expand, hc_head_collapse, hc_mix_weights, rms_norm
from .moe import MoE
from .seq_state import SequenceState


class HyperSite(nn.Module):
    """Parameters of one mHC site (around attention or around the FFN)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def weights(self, streams: torch.Tensor, cfg: ModelConfig):
        return hc_mix_weights(streams, self.fn, self.base, self.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                              cfg.rms_norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, ratio: int, hash_routing: bool):
        super().__init__()
        self.cfg = cfg
        self.attn_norm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.ffn_norm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.hc_attn = HyperSite(cfg)
        self.hc_ffn = HyperSite(cfg)
        self.attn = Attention(cfg, kind, ratio)
        self.ffn = MoE(cfg, hash_routing)

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, rope: StepRope,
                ctx, layer: int) -> torch.Tensor:
        """streams: [T, n, D] → [T, n, D]."""
        eps = self.cfg.rms_norm_eps
        pre, post, comb = self.hc_attn.weights(streams, self.cfg)
        x = rms_norm(hc_collapse(streams, pre), self.attn_norm, eps)
        streams = hc_expand(streams, self.attn(x, positions, rope, ctx, layer), post, comb)
        pre, post, comb = self.hc_ffn.weights(streams, self.cfg)
        x = rms_norm(hc_collapse(streams, pre), self.ffn_norm, eps)
        return hc_expand(streams, self.ffn(x, token_ids), post, comb)


class HyperHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.fn = nn.Parameter(torch.empty(n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.empty(n))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        return hc_head_collapse(streams, self.fn, self.base, self.scale, cfg.hc_eps, cfg.rms_norm_eps)


class DeepseekV4(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(
            Block(cfg, cfg.layer_kinds[i], cfg.compress_ratios[i], cfg.hash_layers[i]) for i in range(cfg.num_layers)
        )
        self.hc_head = HyperHead(cfg)
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.mtp: nn.ModuleList = nn.ModuleList()  # filled by engine.v4.mtp when the checkpoint has MTP weights
        self.rope_main = RotaryTable(cfg.rope_dim, cfg.rope_theta, None)
        self.rope_compress = RotaryTable(cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn)
        # Layers run so far (eagerly; a replayed CUDA graph runs no Python). The worker's
        # heartbeats carry it so the watchdog tells a slow step from a stuck one.
        self.layers_run = 0

    # ---- state -----------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_state(self, slack: int = 8) -> SequenceState:
        """A dense state for every layer, MTP layers (window only) after the model's."""
        cfg = self.cfg
        kinds = list(cfg.layer_kinds) + ["swa"] * len(self.mtp)
        ratios = list(cfg.compress_ratios) + [0] * len(self.mtp)
        return SequenceState(cfg, kinds, ratios, self.dtype, self.device, slack)

    def step_rope(self, positions: torch.Tensor) -> StepRope:
        return StepRope(self.rope_main(positions), self.rope_compress(positions), self.rope_compress)

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """token_ids, positions: [T]. Returns the final residual streams [T, n, D] (pre hc-head).

        `ctx` is the step's attention context (engine/v4/attention.py `SequenceContext`, or a
        static-shape `DecodeBatch`): it says where each token's KV lives and is written."""
        rope = self.step_rope(positions)
        streams = self.embed[token_ids].unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for i, block in enumerate(self.layers):
            streams = block(streams, token_ids, positions, rope, ctx, i)
            self.layers_run += 1
        return streams

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, n, D] streams → [T, vocab] fp32 logits."""
        x = rms_norm(self.hc_head(streams, self.cfg), self.norm, self.cfg.rms_norm_eps)
        return kernels.dense_linear(x, self.head).float()  # a decode-sized CPU product: kernels/cpu_gemv.py
