"""The trainable V4: transformers' DeepseekV4ForCausalLM plus an MTP layer, and their losses.

transformers' model (the project's reference definition of V4) is trained as it is. It has no
MTP layer, so `MTPHead` states ringserve's (engine/v4/mtp.py, model-spec §2.7) differentiably
around transformers' own decoder layer, with a sliding-window layer type and a learned router:
    h = h_proj(hnorm(H_p)) + e_proj(enorm(emb(t_{p+1})))   emb zeroed at position 0
    logits = head(norm(hc_head(Block_swa(h))))             predicts t_{p+2}
The embedding and the output head are the main model's.

Besides next-token (and MTP next-next-token) cross entropy, training does what the V4 recipe
does outside the loss gradient:
  * learned routers keep balanced loads through their selection bias (aux-loss-free
    balancing): after each step every expert's bias moves by ±rate towards the mean load;
  * the lightning indexer, which the LM loss cannot reach (its top-k is discrete), learns by a
    KL loss from the main attention's distribution over the entries it selected to its own
    scores over them; that loss updates the indexer's parameters only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from engine.config import ModelConfig


def transformers_config(cfg: ModelConfig) -> transformers.DeepseekV4Config:
    return transformers.DeepseekV4Config(**cfg.to_transformers_dict())


def hash_table(token_counts: torch.Tensor, num_experts: int, k: int) -> torch.Tensor:
    """tid2eid [V, k]: k distinct experts per token, frequent tokens first onto the least-loaded
    experts, so hash-routed layers see balanced loads on the training corpus."""
    load = [0] * num_experts
    table = torch.zeros(len(token_counts), k, dtype=torch.long)
    for tid in torch.argsort(token_counts, descending=True, stable=True).tolist():
        experts = sorted(range(num_experts), key=lambda e: (load[e], e))[:k]
        table[tid] = torch.tensor(experts)
        for e in experts:
            load[e] += int(token_counts[tid]) + 1  # +1: unseen tokens still spread out
    return table


class MTPHead(nn.Module):
    """ringserve's MTP layer (engine/v4/mtp.py) as a differentiable module over whole windows."""

    def __init__(self, config: transformers.DeepseekV4Config):
        super().__init__()
        d = config.hidden_size
        self.window = config.sliding_window
        self.enorm = hf.DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.hnorm = hf.DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        block_config = transformers.DeepseekV4Config(**{**config.to_dict(), "num_hidden_layers": 1,
                                                        "layer_types": ["sliding_attention"],
                                                        "mlp_layer_types": ["moe"]})
        block_config._attn_implementation = "eager"  # as the main model resolves it (V4 is eager-only)
        block_config._experts_implementation = "eager"
        self.block = hf.DeepseekV4DecoderLayer(block_config, 0)
        self.hc_head = hf.DeepseekV4HyperHead(config)
        self.norm = hf.DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)

    def forward(self, lm: hf.DeepseekV4ForCausalLM, streams: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """streams [B, S, n, D] after tokens at positions 0..S-1; next_ids [B, S] (token p+1 of
        row p). Returns logits [B, S, V] for the token after next."""
        seq = streams.shape[1]
        positions = torch.arange(seq, device=streams.device)
        emb = lm.model.embed_tokens(next_ids)  # [B, S, D]
        emb = torch.where((positions == 0)[None, :, None], torch.zeros_like(emb), emb)
        h = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(emb)).unsqueeze(2)  # [B, S, n, D]
        cos_sin = lm.model.rotary_emb(h, positions[None], layer_type="main")
        q, k = positions[:, None], positions[None, :]
        visible = (k <= q) & (k > q - self.window)
        mask = torch.zeros(seq, seq, device=h.device).masked_fill(~visible, float("-inf"))[None, None]  # [1, 1, S, S]
        out = self.block(h, input_ids=next_ids, position_embeddings={"main": cos_sin}, position_ids=positions[None],
                         attention_mask=mask, past_key_values=None)
        return lm.lm_head(self.norm(self.hc_head(out)))


def build(cfg: ModelConfig, seed: int, token_counts: torch.Tensor) -> tuple[hf.DeepseekV4ForCausalLM, MTPHead]:
    """Freshly initialised model and MTP layer (transformers' init: N(0, 0.02) matrices, unit norms)."""
    torch.manual_seed(seed)
    config = transformers_config(cfg)
    lm = hf.DeepseekV4ForCausalLM(config)
    mtp = MTPHead(config)
    for module in mtp.modules():
        lm._init_weights(module)
    table = hash_table(token_counts, cfg.n_routed_experts, cfg.num_experts_per_tok)
    with torch.no_grad():
        for layer in lm.model.layers:
            if layer.mlp.is_hash:
                layer.mlp.gate.tid2eid.copy_(table)
    return lm, mtp


@dataclass
class Probes:
    """Forward hooks recording what the losses and the bias update need from one forward."""

    streams: torch.Tensor | None = None  # [B, S, n, D] final streams, pre hc head
    router_picks: dict[nn.Module, torch.Tensor] = field(default_factory=dict)  # router → [B*S, k] expert ids
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)  # CSA layer → [B, S, T]
    index_picks: dict[int, torch.Tensor] = field(default_factory=dict)  # CSA layer → [B, S, k], -1 = none
    attn_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # CSA layer → [B, H, S, S + T]
    handles: list = field(default_factory=list)

    def attach(self, lm: hf.DeepseekV4ForCausalLM, mtp: MTPHead) -> "Probes":
        def keep(store, key, index=None):
            return lambda module, args, out: store.__setitem__(key, out if index is None else out[index])

        self.handles.append(lm.model.layers[-1].register_forward_hook(
            lambda module, args, out: setattr(self, "streams", out)))
        for module in list(lm.modules()) + list(mtp.modules()):
            if isinstance(module, hf.DeepseekV4TopKRouter):
                self.handles.append(module.register_forward_hook(keep(self.router_picks, module, 2)))
        for i, layer in enumerate(lm.model.layers):
            compressor = layer.self_attn.compressor
            if isinstance(compressor, hf.DeepseekV4CSACompressor):
                self.handles.append(compressor.indexer.scorer.register_forward_hook(keep(self.index_scores, i)))
                self.handles.append(compressor.indexer.register_forward_hook(keep(self.index_picks, i)))
                self.handles.append(layer.self_attn.register_forward_hook(keep(self.attn_probs, i, 1)))
        return self

    def detach_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def indexer_kl(scores: torch.Tensor, picks: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean over queries with a selection of KL(attention's distribution over the selected
    entries ‖ softmax of the indexer's scores over them). scores [B, S, T]; picks [B, S, k]
    (-1 = no entry); probs [B, H, S, S + T], the compressed entries last."""
    t = scores.shape[-1]
    selected = torch.zeros(scores.shape[:2] + (t + 1,), dtype=torch.bool, device=scores.device)
    selected.scatter_(-1, torch.where(picks >= 0, picks, t), True)
    selected = selected[..., :t]  # [B, S, T]
    mass = probs[..., -t:].float().sum(dim=1).detach()  # [B, S, T]; zero outside the selection
    rows = selected.any(dim=-1) & (mass.sum(-1) > 0)  # [B, S]
    target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
    log_q = torch.log_softmax(scores.float().masked_fill(~selected, float("-inf")), dim=-1)
    terms = torch.where(selected & (target > 0), target * (target.clamp_min(1e-30).log() - log_q), 0.0)
    return terms.sum(-1)[rows].mean() if rows.any() else scores.sum() * 0.0


@dataclass
class Losses:
    lm: torch.Tensor  # mean next-token cross entropy (nats)
    mtp: torch.Tensor  # mean next-next-token cross entropy of the MTP layer (nats)
    kl: torch.Tensor  # mean indexer KL over CSA layers


def losses(lm: hf.DeepseekV4ForCausalLM, mtp: MTPHead, probes: Probes, window: torch.Tensor) -> Losses:
    """window [B, L+1] token ids: inputs window[:, :L]; targets one and two tokens ahead."""
    inputs = window[:, :-1]
    logits = lm(input_ids=inputs).logits  # [B, L, V]
    vocab = logits.shape[-1]
    lm_loss = F.cross_entropy(logits.float().reshape(-1, vocab), window[:, 1:].reshape(-1))
    # MTP rows 0..L-2: streams after t_p, next token t_{p+1}, target t_{p+2}.
    mtp_logits = mtp(lm, probes.streams[:, :-1], inputs[:, 1:])  # [B, L-1, V]
    mtp_loss = F.cross_entropy(mtp_logits.float().reshape(-1, vocab), window[:, 2:].reshape(-1))
    kls = [indexer_kl(probes.index_scores[i], probes.index_picks[i], probes.attn_probs[i])
           for i in sorted(probes.index_scores)]
    kl = torch.stack(kls).mean() if kls else lm_loss * 0.0
    return Losses(lm_loss, mtp_loss, kl)


@torch.no_grad()
def update_router_bias(probes: Probes, num_experts: int, rate: float) -> None:
    """Aux-loss-free balancing: each learned router's selection bias moves towards even load."""
    for router, picks in probes.router_picks.items():
        load = torch.bincount(picks.reshape(-1), minlength=num_experts).float()
        router.e_score_correction_bias += rate * torch.sign(load.mean() - load)
    probes.router_picks.clear()


def indexer_parameters(lm: hf.DeepseekV4ForCausalLM) -> list[nn.Parameter]:
    return [p for name, p in lm.named_parameters() if ".indexer." in name]
