"""Trained weights → a ringserve checkpoint (upstream layout, as released V4 checkpoints are).

Every parameter of ringserve's model (engine/v4/model.py, engine/v4/mtp.py) is looked up by name:
main-model tensors through the transformers layout's names (engine/weight_names.py
`export_names`, the mapping the loader itself uses), MTP tensors in `MTPHead`, whose block is
a transformers decoder layer and so uses the same names. Nothing is reshaped: transformers'
stacked experts and ringserve's `w13`/`w2` share a layout, and `write_checkpoint` splits them
per expert for the upstream layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from engine.config import ModelConfig
from engine.v4.checkpoint import write_checkpoint
from engine.v4.weight_names import export_names
from engine.v4.weights import build_model

from .v4 import MTPHead

# MTP tensors outside its block: ringserve name (after `mtp.0.`) → MTPHead state-dict name.
_MTP_OWN = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "e_proj.weight": "e_proj.weight",
            "h_proj.weight": "h_proj.weight",
            "norm": "norm.weight", "hc_head.fn": "hc_head.hc_fn", "hc_head.base": "hc_head.hc_base",
            "hc_head.scale": "hc_head.hc_scale"}


def _transformers_name(internal: str, cfg: ModelConfig) -> str:
    return export_names(internal, "transformers", cfg.n_routed_experts)[0][0]


def internal_state(cfg: ModelConfig, lm: hf.DeepseekV4ForCausalLM, mtp: MTPHead) -> dict[str, torch.Tensor]:
    """ringserve parameter name → fp32 (int32 for tid2eid) tensor, for every parameter of the
    model with its MTP layer."""
    lm_state, mtp_state = lm.state_dict(), mtp.state_dict()
    target = build_model(cfg, with_mtp=True)  # on the meta device: names and shapes only
    out: dict[str, torch.Tensor] = {}
    for name, param in list(target.named_parameters()) + list(target.named_buffers()):
        if name.startswith("mtp.0.block."):
            inner = _transformers_name("layers.0." + name.removeprefix("mtp.0.block."), cfg)
            value = mtp_state["block." + inner.removeprefix("model.layers.0.")]
        elif name.startswith("mtp.0."):
            value = mtp_state[_MTP_OWN[name.removeprefix("mtp.0.")]]
        else:
            value = lm_state[_transformers_name(name, cfg)]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{name}: trained shape {tuple(value.shape)}, ringserve expects {tuple(param.shape)}")
        value = value.detach().to("cpu")
        out[name] = value.to(torch.int32) if not param.dtype.is_floating_point else value.float()
    return out


def export_checkpoint(out_dir: Path, cfg: ModelConfig, lm: hf.DeepseekV4ForCausalLM, mtp: MTPHead,
                      dtype: torch.dtype = torch.bfloat16) -> Path:
    """config.json, generation_config.json and model.safetensors (upstream layout) in out_dir."""
    return write_checkpoint(out_dir, cfg, internal_state(cfg, lm, mtp), layout="upstream", dtype=dtype)
