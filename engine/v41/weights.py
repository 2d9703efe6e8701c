"""Load a DeepSeek-V4.1 release directory (config.json with text_config, safetensors with the
release's tensor names) into `V41Model`, through engine/weights.py's streaming machinery.

The model's parameter names are the release names (engine/weight_names.py `v41_target_of`
maps them; only the routed experts differ: per-expert w1/w3/w2 fill the stacked w13 / w2).
Storage, as released: FP8 e4m3 with E8M0 32×32 block scales (projections, shared experts,
indexer wq_b, Engram wkv, DSpark main_proj), FP4 e2m1 pairs with E8M0 per 32 along K (routed
experts), FP8 Engram tables with one E8M0 scale per row per 32, BF16 / F32 the rest.
`weight_dtype='auto'` keeps FP8/FP4 as stored; 'bf16' decodes them at load (exactly: every
stored value fits bf16). With `experts` (expert parallelism: engine/distributed/expert_parallel.py
`experts_to_load`), each listed MoE layer holds only those logical experts, read alone from the
shards; unlisted layers (the DSpark stages) hold all of theirs. With `engram_tables='host'` the
Engram tables are allocated and filled in CPU memory, never on the device.

A checkpoint with a vision tower (`vision_config.num_hidden_layers` > 0) loads it with no flag:
the release's `vision.*`, `aligner.*` and `image_start` / `image_end` / `image_newline` fill
`encoder.*` (engine/v41/vision/encoder.py), every Gate's `bias_vl` its routing bias for image
positions. `language_model_only` (vLLM's --language-model-only) builds no tower and reads none of
its tensors; such a model refuses image input.
"""

from __future__ import annotations

from dataclasses import replace

import logging
from pathlib import Path

import torch
from torch import nn

from ..config import ENGRAM_TABLES, WEIGHT_DTYPES, ModelConfig
from ..weight_names import Target
from ..weights import Checkpoint, Filler, WeightLoadError, is_scale, shard_files, stored_formats
from .dspark import DSparkStage
from .model import V41Model
from .vision.encoder import internal_name as vision_internal_name
from .weight_names import v41_target_of

logger = logging.getLogger(__name__)


def build_v41(cfg: ModelConfig, with_dspark: bool, experts: dict[int, list[int]] | None = None,
              with_encoder: bool = True) -> V41Model:
    """The model on the meta device; `experts`: MoE layer id (DSpark stage s = num_layers + s) →
    the logical experts its slots hold; `with_encoder`: the vision tower, when the config has one."""
    with torch.device("meta"):
        model = V41Model(cfg, with_encoder)
        if with_dspark:
            model.mtp.extend(DSparkStage(cfg, s) for s in range(cfg.num_nextn_predict_layers))
    if experts is not None:
        for layer, moe in moe_layers(model):
            if layer in experts:
                moe.experts.select(experts[layer])
    return model


def moe_layers(model: V41Model) -> list[tuple[int, nn.Module]]:
    """(layer id, MoE) of the backbone, then of the DSpark stages (num_layers + s)."""
    return [(i, b.ffn) for i, b in enumerate(model.layers)] + [(s.layer, s.ffn) for s in model.mtp]


def targets_of(ckpt: Checkpoint, expected: set[str], load_stages: bool, load_encoder: bool) -> dict:
    out = {}
    for name in ckpt.location:
        if is_scale(name, ckpt.location):
            continue
        if name.startswith("mtp.") and not load_stages:
            out[name] = None  # read nothing, but account for it
            continue
        vision = vision_internal_name(name)
        if vision is not None and not load_encoder:
            out[name] = None
            continue
        target = Target(vision) if vision is not None else v41_target_of(name)
        if target is None or target.internal not in expected:
            raise WeightLoadError(f"unexpected tensor {name} in {ckpt.location[name].name}")
        out[name] = target
    return out


def model_shards(model_dir: Path) -> list[Path]:
    """The index's shards, else `model.safetensors` alone when present (a directory may hold
    other safetensors files, e.g. golden logprobs), else every `*.safetensors`."""
    if not (model_dir / "model.safetensors.index.json").exists() and (model_dir / "model.safetensors").exists():
        return [model_dir / "model.safetensors"]
    return shard_files(model_dir)


def _materialize(model: V41Model, device: str, engram_tables: str) -> None:
    """Allocate every tensor on `device`; with engram_tables 'host' the Engram tables on the CPU
    instead, never on the device (the released tables alone exceed one GPU)."""
    if engram_tables == "device":
        model.to_empty(device=device)
        return
    parents = [block.engram for block in model.layers if getattr(block, "engram", None) is not None]
    tables = [parent._modules.pop("embed") for parent in parents]  # out of the device allocation
    model.to_empty(device=device)
    for parent, table in zip(parents, tables):
        parent.embed = table.to_empty(device="cpu")


def load_v41(model_dir: str | Path, device: str = "cpu", progress: bool = False, load_mtp: bool = True,
             weight_dtype: str = "auto", experts: dict[int, list[int]] | None = None,
             engram_tables: str = "device", language_model_only: bool = False) -> V41Model:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    if engram_tables not in ENGRAM_TABLES:
        raise ValueError(f"engram_tables must be one of {', '.join(ENGRAM_TABLES)}, got {engram_tables!r}")
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_model_dir(model_dir)
    ckpt = Checkpoint(model_shards(model_dir))
    has_stages = any(n.startswith("mtp.") for n in ckpt.location)
    model = build_v41(cfg, load_mtp and has_stages and cfg.num_nextn_predict_layers > 0,
                      with_encoder=not language_model_only)
    names = {n for n, _ in model.named_parameters()}
    targets = targets_of(ckpt, names, len(model.mtp) > 0, model.encoder is not None)
    if weight_dtype == "auto":
        for path, fmt in stored_formats(model, ckpt, targets).items():
            model.get_submodule(path).set_format(fmt)
    if experts is not None:
        for layer, moe in moe_layers(model):
            if layer in experts:
                moe.experts.select(experts[layer])
    _materialize(model, device, engram_tables)
    # Host tables are the checkpoint's own mapped pages: the ranks of a node share one copy.
    tables = frozenset(p for p, _ in model.named_modules() if p.endswith(".engram.embed")) \
        if engram_tables == "host" else frozenset()
    filler = Filler(model, ckpt, adopt=tables)
    with torch.no_grad():
        for name, target in targets.items():
            filler.fill(name, target)
    filler.check_complete()
    leftover = set(ckpt.location) - filler.consumed
    if leftover:
        raise WeightLoadError(f"unexpected tensor {sorted(leftover)[0]} (unused scale or extra tensor)")
    model.train(False).requires_grad_(False)
    model.prepare(model_dir)
    if model.device.type == "cuda":
        # The reference's exact block GEMMs form every product in fp64 (fp64 copies of the weights,
        # fp64 arithmetic): a CPU's way to REF's bits, never a GPU's. On CUDA the kernels'
        # fp32-accumulated FP8/FP4 GEMMs (engine/v41/numerics.py `exact=False`).
        model.numerics = replace(model.numerics, exact=False)
    logger.info("loaded V4.1 %s (%d tensors, %.1f MiB read), weights %s", model_dir, len(targets),
                filler.bytes_read / 2**20, weight_dtype)
    return model

