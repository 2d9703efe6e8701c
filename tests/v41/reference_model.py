"""The plain DeepSeek-V4.1 reference forward: one sequence, no paging, no batching.

`ReferenceV41.forward(state, token_ids)` runs any chunk at positions [state.length, +T):
a whole prompt (REF's prefill), one token (REF's decode) or a middle chunk (chunked prefill,
which REF cannot do). Per layer: Engram (its layers), then the block — mHC with the *delayed*
pre: a block's attention input collapses the stream with the previous FFN site's `pre`
(a one-hot on stream 0 for layer 0), its FFN input with its own attention site's `pre`; the
model end collapses with the last FFN site's `pre` (V4.1 has no hc_head). MoE: sqrt-softplus
router / gate_temp, bias for selection only, clamped SwiGLU, no hash layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .engram_hash import EngramHasher, load_token_map
from .ref_attention import RefOptions, attention
from .ref_ops import (fp32_linear, hc_collapse, hc_expand, hc_mixes, quantized_linear, rms_norm,
                      row_independent_numerics, sigmoid, silu, softplus)
from .ref_state import ForwardHandoff, IndexTrace, SequenceState
from .release_checkpoint import ReleaseCheckpoint, V41Config

ENGRAM_GATE_FLOOR = 1e-6  # |dot| floor under the signed square root


def route(w: dict, p: str, cfg: V41Config, x: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, dim] → (weights fp32 [T, k], experts [T, k]). Scores sqrt(softplus(logits / gate_temp))
    in fp32; the bias picks the experts, the raw scores weight them; weights are normalised by
    (sum + 1e-20) only when k > 1, then times routed_scaling_factor."""
    scores = softplus(fp32_linear(x, w[f"{p}.gate.weight"]) / cfg.gate_temp).sqrt()
    experts = (scores + w[f"{p}.gate.bias"]).topk(topk, dim=-1).indices
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.route_scale, experts


def expert(w: dict, p: str, cfg: V41Config, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """Clamped SwiGLU [n, dim] → [n, dim] bf16: up clamped to ±limit, gate only from above; the
    routing weight multiplies the fp32 activation before w2 (REF), not the output."""
    gate = quantized_linear(x, w[f"{p}.w1.weight"]).float().clamp(max=cfg.swiglu_limit)
    up = quantized_linear(x, w[f"{p}.w3.weight"]).float().clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
    h = silu(gate) * up
    if weight is not None:
        h = weight * h
    return quantized_linear(h.to(torch.bfloat16), w[f"{p}.w2.weight"])


def moe(w: dict, p: str, cfg: V41Config, x: torch.Tensor, n_experts: int, topk: int) -> torch.Tensor:
    """[T, dim] bf16 → [T, dim] bf16. Expert outputs (bf16) accumulate in fp32 in ascending expert
    order, the shared expert last, then one rounding to bf16."""
    weights, experts = route(w, p, cfg, x, topk)
    y = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(n_experts):
        tokens, slot = torch.where(experts == e)
        if tokens.numel():
            y[tokens] += expert(w, f"{p}.experts.{e}", cfg, x[tokens], weights[tokens, slot, None])
    y += expert(w, f"{p}.shared_experts", cfg, x, None)
    return y.to(torch.bfloat16)


def engram(w: dict, p: str, cfg: V41Config, stream: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
    """stream [T, hc, dim] bf16, hash_ids [T, cols] → stream with a gated per-stream update.

    The gathered rows (bf16) map through wkv to one key per stream plus a shared value. The
    gate σ(signed_sqrt(⟨H_k, q⊙k_w⊙key_k⟩ · rstd(H_k) · rstd(key_k) / √dim)) normalises each
    stream and key separately (not jointly over streams), all in fp32."""
    hc, dim = cfg.hc_mult, cfg.dim
    rows = w[f"{p}.embed.weight"][hash_ids]  # [T, cols, head_dim] bf16
    kv = quantized_linear(rows.flatten(1), w[f"{p}.wkv.weight"])  # [T, (hc + 1)·dim] bf16
    key, value = kv.split([hc * dim, dim], dim=-1)
    key = key.float().unflatten(-1, (hc, dim))
    weight = w[f"{p}.q_weight"].float() * w[f"{p}.k_weight"].float()  # [hc, dim]
    h, eps = stream.float(), cfg.norm_eps
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)  # [T, hc]
    dot = (h * weight * key).sum(-1) * rstd * dim**-0.5
    gate = sigmoid(torch.copysign(dot.abs().clamp_min(ENGRAM_GATE_FLOOR).sqrt(), dot))
    return (h + gate[..., None] * value.float()[:, None, :]).to(torch.bfloat16)


def block(w: dict, p: str, cfg: V41Config, stream: torch.Tensor, pre_mix: torch.Tensor, attend, n_experts: int,
          topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder block with delayed-pre mHC. `attend(x [T, dim]) -> [T, dim]` is the attention.
    Returns (stream [T, hc, dim], this block's FFN-site pre for the next collapse)."""
    mix = dict(hc=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps)
    attn_pre, attn_post, attn_comb = hc_mixes(stream, w[f"{p}.hc_attn_fn"], w[f"{p}.hc_attn_scale"],
                                              w[f"{p}.hc_attn_base"], **mix)
    x = rms_norm(hc_collapse(stream, pre_mix), w[f"{p}.attn_norm.weight"], cfg.norm_eps)
    stream = hc_expand(attend(x), stream, attn_post, attn_comb)
    ffn_pre, ffn_post, ffn_comb = hc_mixes(stream, w[f"{p}.hc_ffn_fn"], w[f"{p}.hc_ffn_scale"],
                                           w[f"{p}.hc_ffn_base"], **mix)
    x = rms_norm(hc_collapse(stream, attn_pre), w[f"{p}.ffn_norm.weight"], cfg.norm_eps)
    stream = hc_expand(moe(w, f"{p}.ffn", cfg, x, n_experts, topk), stream, ffn_post, ffn_comb)
    return stream, ffn_pre


def identity_pre(t: int, hc: int) -> torch.Tensor:
    """The collapse before any site has spoken: all weight on stream 0. [T, hc] fp32."""
    pre = torch.zeros(t, hc)
    pre[:, 0] = 1.0
    return pre


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # fp32 [T, V]
    main_hidden: torch.Tensor  # bf16 [T, n_targets·dim]: hc-mean attention inputs of the DSpark targets
    index_trace: dict[int, IndexTrace]  # index-source layer → its selection


class ReferenceV41:
    def __init__(self, ckpt: ReleaseCheckpoint, token_map: list[int] | None = None,
                 options: RefOptions = RefOptions()):
        self.cfg, self.w, self.opts = ckpt.config, ckpt.weights, options
        if token_map is None:
            token_map, size = load_token_map(Path(ckpt.model_dir) / "engram_token_map.json")
            assert size == self.cfg.engram_compressed_vocab_size, "token map does not match the config"
        self.hasher = EngramHasher.for_config(self.cfg, token_map)

    def new_state(self) -> SequenceState:
        return SequenceState()

    def forward(self, state: SequenceState, token_ids: list[int]) -> ForwardOutput:
        """Process token_ids at positions [state.length, state.length + T); advances the state."""
        with row_independent_numerics(self.opts.row_independent):
            return self._forward(state, token_ids)

    def _forward(self, state: SequenceState, token_ids: list[int]) -> ForwardOutput:
        cfg, w, pos0, t = self.cfg, self.w, state.length, len(token_ids)
        state.engram_ids.extend(self.hasher.compress(token_ids))
        hashes = self.hasher.hash_ids(state.engram_ids, pos0, pos0 + t)  # [T, n_engram_layers, cols]
        stream = w["embed.weight"][torch.tensor(token_ids)][:, None, :].repeat(1, cfg.hc_mult, 1)  # [T, hc, dim]
        pre_mix, handoff, targets = identity_pre(t, cfg.hc_mult), ForwardHandoff(), []
        for layer in range(cfg.n_layers):
            p = f"layers.{layer}"
            if layer in cfg.engram_layer_ids:
                slot = cfg.engram_layer_ids.index(layer)
                stream = engram(w, f"{p}.engram", cfg, stream, hashes[:, slot])
            if layer in cfg.dspark_target_layer_ids:  # DSpark reads the attention input, not the output
                targets.append(stream.mean(dim=1))

            def attend(x, layer=layer):
                return attention(w, cfg, layer, x, pos0, state, handoff, self.opts)

            stream, pre_mix = block(w, p, cfg, stream, pre_mix, attend, cfg.n_routed_experts, cfg.n_activated_experts)
        state.length += t
        x = rms_norm(hc_collapse(stream, pre_mix), w["norm.weight"], cfg.norm_eps)
        # REF holds the head in fp32 and runs it on one row (the last): fp32 GEMM results depend
        # on the row count on CPU, so every row goes through alone to match it at any position
        logits = torch.cat([fp32_linear(x[i:i + 1], w["head.weight"]) for i in range(t)])
        main_hidden = torch.cat(targets, dim=-1) if targets else torch.zeros(t, 0, dtype=torch.bfloat16)
        return ForwardOutput(logits, main_hidden, handoff.trace)

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        """Full forward of a fresh sequence → logits [T, V] fp32."""
        return self.forward(self.new_state(), token_ids).logits
