"""V4.1 on the meta device with its stored formats and expert share (`ringserve memory-report`,
through engine/v41/architecture.py `meta_model`): built in the order `load_v41` builds it —
the release dtypes of `V41Model` (no cast), the stored formats, then the expert share of the
backbone's MoE layers (the DSpark stages stay whole on every rank, as the engine places them).
Nothing is read but config.json and safetensors headers."""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.reference import FP4_GROUP

from ..linear import QuantWeight, RoutedExperts, WeightFormat
from ..weights import Checkpoint, stored_formats
from .checkpoint import fp8_stored
from .weights import build_v41, model_shards, moe_layers, targets_of


def meta_model(cfg, source: Path, weight_dtype: str, with_dspark: bool, experts: dict[int, list[int]] | None):
    model = build_v41(cfg, with_dspark)
    for path, fmt in formats(model, cfg, source, weight_dtype).items():
        model.get_submodule(path).set_format(fmt)
    if experts is not None:
        for layer, moe in moe_layers(model):
            if layer in experts:
                moe.experts.select(experts[layer])
    return model


def formats(model, cfg, source: Path, weight_dtype: str) -> dict:
    """Module path → stored format: a checkpoint's from its headers (as `load_v41` reads them),
    else what the release's `quantization_config` describes."""
    if weight_dtype == "bf16":
        return {}
    if source.is_dir() and any(source.glob("*.safetensors")):
        ckpt = Checkpoint(model_shards(source))
        targets = targets_of(ckpt, {n for n, _ in model.named_parameters()}, len(model.mtp) > 0,
                             getattr(model, "encoder", None) is not None)
        return stored_formats(model, ckpt, targets)
    return formats_from_config(model, cfg)


def formats_from_config(model, cfg) -> dict:
    """The V4.1 release's storage (engine/v41/checkpoint.py, which writes it): FP8 e4m3 with E8M0
    `weight_block_size` blocks for the projections it names, FP8 Engram tables with one scale per
    row per 32, FP4 routed experts (one scale per 32 along K); {} for an unquantized config."""
    q = cfg.quantization or {}
    if q.get("quant_method") != "fp8":
        return {}
    scale_dtype = torch.float8_e8m0fnu if q.get("scale_fmt") == "ue8m0" else torch.float32
    dense = WeightFormat.fp8(tuple(q.get("weight_block_size", (32, 32))), scale_dtype)
    experts = WeightFormat.fp4(FP4_GROUP, scale_dtype) if q.get("expert_dtype") == "fp4" else dense
    plan = {}
    for path, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            plan[f"{path}.w13"] = plan[f"{path}.w2"] = experts
        elif isinstance(module, QuantWeight) and path.endswith("engram.embed"):
            plan[path] = WeightFormat.fp8((1, FP4_GROUP), scale_dtype)  # a row's 32-value groups
        elif isinstance(module, QuantWeight) and fp8_stored(f"{path}.weight"):
            plan[path] = dense
    return plan
