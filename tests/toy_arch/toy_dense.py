"""A third, test-only architecture: a small dense decoder served through engine/models/ alone.

`toy_dense` (config.json `model_type: "toy_dense"`) is a plain pre-norm transformer: each layer
is DeepSeek-V4's sliding-window attention (the engine's `Attention`, window-only: no compressor,
no indexer) and a dense SwiGLU MLP on a single residual stream (no mHC, no MoE), then a final
RMSNorm and an untied LM head. It reuses V4's KV layout (one `swa` pool), cache and runner, and
has no drafter, no static decode path and no image input.

Adding it touched no engine or server file: this module subclasses `Architecture` and
registers itself when imported; `RINGSERVE_ARCHITECTURES=toy_dense` (with this folder on
PYTHONPATH) makes every process — the HTTP front and its workers — import it.

`reference_logits` restates the forward from the checkpoint's tensors in plain torch (full
causal attention over the window, no KV cache, no engine), the tests' independent reference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.models import registry
from engine.models.base import Architecture, Capabilities

MODEL_TYPE = "toy_dense"
PRESET = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
              qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=16,
              intermediate_size=96, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=1024,
              bos_token_id=0, eos_token_id=1)


def parse(raw: dict[str, Any]):
    """toy_dense config.json → the engine's ModelConfig: window-only layers, one residual stream."""
    from engine.config import ConfigError, ModelConfig

    missing = [k for k in PRESET if k not in raw]
    if missing:
        raise ConfigError(f"config.json: toy_dense needs '{missing[0]}'")
    n = int(raw["num_hidden_layers"])
    eos = raw["eos_token_id"]
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]), num_layers=n,
        num_heads=int(raw["num_attention_heads"]), head_dim=int(raw["head_dim"]),
        rope_dim=int(raw["qk_rope_head_dim"]), q_lora_rank=int(raw["q_lora_rank"]), o_groups=int(raw["o_groups"]),
        o_lora_rank=int(raw["o_lora_rank"]), sliding_window=int(raw["sliding_window"]), compress_ratios=(0,) * n,
        layer_kinds=("swa",) * n, hash_layers=(False,) * n, index_n_heads=1, index_head_dim=int(raw["head_dim"]),
        index_topk=1, n_routed_experts=0, n_shared_experts=0, num_experts_per_tok=0,
        moe_intermediate_size=int(raw["intermediate_size"]), routed_scaling_factor=1.0, norm_topk_prob=False,
        scoring_func="none", swiglu_limit=0.0, hc_mult=1, hc_sinkhorn_iters=0, hc_eps=0.0,
        rms_norm_eps=float(raw["rms_norm_eps"]), rope_theta=float(raw["rope_theta"]),
        compress_rope_theta=float(raw["rope_theta"]), yarn=None,
        max_position_embeddings=int(raw["max_position_embeddings"]), num_nextn_predict_layers=0,
        bos_token_id=raw["bos_token_id"], eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
        arch=MODEL_TYPE)


# ---- the model --------------------------------------------------------------------------------


class ToyLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        from engine.linear import Linear
        from engine.v4.attention import Attention

        d, f = cfg.hidden_size, cfg.moe_intermediate_size
        self.attn_norm = nn.Parameter(torch.empty(d))
        self.attn = Attention(cfg, "swa", 0)
        self.mlp_norm = nn.Parameter(torch.empty(d))
        self.w1, self.w3, self.w2 = Linear(d, f), Linear(d, f), Linear(f, d)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope, ctx, layer: int) -> torch.Tensor:
        from engine.v4.layers import rms_norm

        eps = self.attn.cfg.rms_norm_eps
        x = x + self.attn(rms_norm(x, self.attn_norm, eps), positions, rope, ctx, layer)
        h = rms_norm(x, self.mlp_norm, eps)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class ToyDense(nn.Module):
    """forward(token_ids [T], positions [T], ctx) → hidden [T, D]; logits(hidden) → [T, V] fp32."""

    def __init__(self, cfg):
        super().__init__()
        from engine.v4.layers import RotaryTable

        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(ToyLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.mtp = nn.ModuleList()  # no drafter
        self.rope = RotaryTable(cfg.rope_dim, cfg.rope_theta, None)
        self.layers_run = 0  # the worker's heartbeats report it

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        from engine.v4.attention import StepRope

        cos_sin = self.rope(positions)
        rope = StepRope(cos_sin, cos_sin, self.rope)
        x = self.embed[token_ids]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, rope, ctx, i)
            self.layers_run += 1
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        from engine.v4.layers import rms_norm

        return (rms_norm(hidden, self.norm, self.cfg.rms_norm_eps) @ self.head.T).float()


# ---- checkpoint ---------------------------------------------------------------------------------


def write_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """config.json, model.safetensors (random fp32 weights) and a tokenizer."""
    from tokenization.synthetic_bpe import write_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = {"model_type": MODEL_TYPE, "architectures": ["ToyDenseForCausalLM"], **PRESET}
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    cfg = parse(raw)
    g = torch.Generator().manual_seed(seed)
    model = ToyDense(cfg)
    state = {}
    for name, p in model.named_parameters():
        if name.endswith("norm"):
            state[name] = 1 + 0.1 * torch.randn(p.shape, generator=g)
        elif name.endswith("attn_sink"):
            state[name] = torch.randn(p.shape, generator=g)
        else:
            state[name] = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
    save_file(state, str(out / "model.safetensors"))
    write_tokenizer(out, cfg.vocab_size)
    return out


def load(model_dir: Path, device: str = "cpu") -> ToyDense:
    from engine.config import ModelConfig

    model = ToyDense(ModelConfig.from_model_dir(model_dir))
    model.load_state_dict(load_file(str(Path(model_dir) / "model.safetensors")), strict=True)
    model.rope.inv_freq = model.rope.inv_freq.to(device)
    return model.to(device).float().train(False).requires_grad_(False)


# ---- the architecture ------------------------------------------------------------------------


class ToyDenseArchitecture(Architecture):
    name = MODEL_TYPE
    display_name = "Toy dense"
    model_types = (MODEL_TYPE,)
    hf_architectures = ("ToyDenseForCausalLM",)
    capabilities = Capabilities()  # no drafter, no async scheduling, no static decode, text only

    def parse_config(self, raw):
        return parse(raw)

    def load_model(self, model_dir, *, dtype, device, progress, load_mtp, weight_dtype, experts, engram_tables,
                   language_model_only):
        if experts is not None:
            raise ValueError("toy_dense has no experts to split")
        return load(Path(model_dir), device)

    def write_checkpoint(self, out_dir, preset, *, seed, quantize, layout, dtype, vision, **overrides):
        if quantize or vision or overrides:
            raise ValueError("toy_dense takes no --quantize, --vision or overrides")
        return write_checkpoint(out_dir, seed)

    def kv_layout(self, cfg, kv_dtype, compute_dtype, block_size, num_mtp_layers, index_dtype):
        from engine.v4.kv_layout import build_v4_layout  # one window pool: every layer is window-only

        return build_v4_layout(cfg, kv_dtype, compute_dtype, block_size, 0, index_dtype)

    def cache_class(self):
        from engine.kv_cache import KVCache

        return KVCache

    def runner(self, model, cache, config, num_drafts, static):
        from engine.model_runner import ModelRunner

        return ModelRunner(model, cache, num_drafts, static)


ARCHITECTURE = registry.register(ToyDenseArchitecture())


# ---- the independent reference ----------------------------------------------------------------


def _rope(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float, sign: float) -> torch.Tensor:
    """Rotate x's last rope_dim channels as interleaved (even, odd) pairs by sign·pos·θ_i."""
    inv = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    ang = sign * positions.double()[:, None] * inv[None, :]  # [T, rope/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    c, s = ang.cos().view(shape), ang.sin().view(shape)
    pairs = x[..., -rope_dim:].double().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim].double(), rotated), dim=-1)


def reference_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """[T, V] fp64 logits of the whole sequence from the checkpoint's tensors, in plain torch."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}
    eps, heads, hd, window = raw["rms_norm_eps"], raw["num_attention_heads"], raw["head_dim"], raw["sliding_window"]
    rd, theta, groups = raw["qk_rope_head_dim"], raw["rope_theta"], raw["o_groups"]

    def norm(x, weight=None):
        y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y if weight is None else y * weight

    t = len(token_ids)
    pos = torch.arange(t)
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # [T, T]
    x = w["embed"][torch.tensor(token_ids)]
    for i in range(raw["num_hidden_layers"]):
        p = f"layers.{i}."
        h = norm(x, w[p + "attn_norm"])
        q = norm(h @ w[p + "attn.wq_a.weight"].T, w[p + "attn.q_norm"]) @ w[p + "attn.wq_b.weight"].T
        q = _rope(norm(q.view(t, heads, hd)), pos, rd, theta, 1.0)  # [T, H, hd]
        kv = _rope(norm(h @ w[p + "attn.wkv.weight"].T, w[p + "attn.kv_norm"]), pos, rd, theta, 1.0)  # [T, hd]
        scores = torch.einsum("thd,sd->hts", q, kv) / math.sqrt(hd)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        sink = w[p + "attn.attn_sink"].view(heads, 1, 1).expand(heads, t, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :t]  # the sink takes its share
        o = _rope(torch.einsum("hts,sd->thd", probs, kv), pos, rd, theta, -1.0)  # [T, H, hd]
        o = o.reshape(t, groups, -1)  # [T, G, H·hd/G]
        wo_a = w[p + "attn.wo_a.weight"].view(groups, -1, o.shape[-1])  # [G, O, H·hd/G]
        low = torch.einsum("tgi,goi->tgo", o, wo_a).flatten(1)
        x = x + low @ w[p + "attn.wo_b.weight"].T
        m = norm(x, w[p + "mlp_norm"])
        x = x + (torch.nn.functional.silu(m @ w[p + "w1.weight"].T) * (m @ w[p + "w3.weight"].T)) @ w[p + "w2.weight"].T
    return norm(x, w["norm"]) @ w["head"].T
