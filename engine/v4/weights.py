"""Load a Hugging Face-format DeepSeek-V4 directory into `DeepseekV4` (`load_v4`, reached
through `engine.weights.load_model` and the registry), and build the model on the meta device.

Reads `config.json`, sharded safetensors (with `model.safetensors.index.json`) or one file,
in the upstream, transformers or saved-by-transformers tensor layout. Quantized weights are
  * FP8 e4m3 with one ue8m0 (or fp32) scale per block (`.scale` / `.weight_scale_inv`);
  * FP4 e2m1 packed two per int8 byte (low nibble = even column) with one ue8m0 scale per 32
    columns (routed experts, `expert_dtype: fp4`).
`weight_dtype="auto"` keeps them as stored, in the containers of engine/linear.py (the GEMM
kernels dequantize tile by tile); `"bf16"` decodes every weight into the compute dtype at
load (the upcast). Unquantized tensors load in the compute dtype either way (fp32 for the
leaves the model defines in fp32).

Loading is streamed: the model is planned and built on the meta device, allocated once on the
target device, and each tensor is read from its shard (safetensors reads lazily, one tensor
at a time), converted and copied into place. Host memory thus holds the model's share (when
the device is the CPU) plus one tensor. With `experts`, each MoE layer holds only the given
logical experts and the other experts' tensors are never read.

Every parameter must be filled exactly once with the right shape; anything else is a
`WeightLoadError` that names the tensor.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..linear import GroupedWeight, QuantWeight, WeightFormat
from ..weight_names import Target
from ..weights import Checkpoint, Filler, WeightLoadError, is_scale, shard_files, stored_formats
from .model import DeepseekV4
from .moe import MoE
from .mtp import MTPLayer
from .weight_names import detect_layout, target_of


logger = logging.getLogger(__name__)


# Parameter leaves the model defines in fp32, kept so whatever the compute dtype.
_FP32_LEAVES = frozenset({"norm", "q_norm", "kv_norm", "attn_norm", "ffn_norm", "enorm", "hnorm", "fn", "base",
                          "scale", "attn_sink", "ape", "gate_bias"})


def keeps_fp32(internal: str) -> bool:
    return internal.rpartition(".")[2] in _FP32_LEAVES


def build_model(cfg: ModelConfig, with_mtp: bool, dtype: torch.dtype | None = None,
                formats: dict[str, WeightFormat] | None = None,
                experts: dict[int, list[int]] | None = None) -> DeepseekV4:
    """The model on the meta device (no storage).

    dtype: the dtype of floating parameters (fp32-defined leaves stay fp32); None keeps fp32.
    formats: module path of a `QuantWeight` → its stored format (others dense).
    experts: MoE layer id → the logical experts its local slots hold (MTP layer i is layer
    num_layers + i); a layer that is not a key holds every expert."""
    with torch.device("meta"):
        model = DeepseekV4(cfg)
        if with_mtp:
            model.mtp.extend(MTPLayer(cfg, i) for i in range(cfg.num_nextn_predict_layers))
    if dtype is not None:
        _cast(model, dtype)
    configure(model, formats or {}, experts)
    return model


def _cast(model: nn.Module, dtype: torch.dtype) -> None:
    for path, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            want = torch.float32 if keeps_fp32(f"{path}.{name}" if path else name) else dtype
            if p.is_floating_point() and p.dtype != want:
                setattr(module, name, nn.Parameter(p.to(want), requires_grad=False))


def moe_layers(model: DeepseekV4) -> list[tuple[int, MoE]]:
    """(layer id, MoE) of every MoE layer: the model's, then MTP's (layer num_layers + i)."""
    return [(i, block.ffn) for i, block in enumerate(model.layers)] + [(m.layer_id, m.block.ffn) for m in model.mtp]


def configure(model: DeepseekV4, formats: dict[str, WeightFormat], experts: dict[int, list[int]] | None) -> None:
    """Apply a format plan and an expert share to a model on the meta device."""
    for path, fmt in formats.items():
        module = model.get_submodule(path)
        if not isinstance(module, QuantWeight):
            raise ValueError(f"{path} is not a weight container")
        module.set_format(fmt)
    if experts is None:
        return
    limit = model.cfg.num_layers + model.cfg.num_nextn_predict_layers
    bad = [layer for layer in experts if not 0 <= layer < limit]
    if bad:
        raise ValueError(f"experts given for layers {bad}; MoE layers are 0..{limit - 1} (MTP after the model's)")
    for layer, moe in moe_layers(model):
        if layer in experts:
            moe.experts.select(experts[layer])


def _materialize(model: nn.Module, device: str | torch.device) -> None:
    """Allocate every parameter and buffer (uninitialised) on `device`, in its storage layout."""
    # What Module.to_empty does, without its empty_like: on meta tensors that runs torch's Python
    # decompositions, whose first use imports sympy (~0.5 s of every worker's start).
    model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
    for module in model.modules():
        if isinstance(module, GroupedWeight):
            module.relayout()


def _targets(ckpt: Checkpoint, layout: str, expected: set[str], load_mtp: bool) -> dict[str, Target | None]:
    """Checkpoint weight name (scales excluded) → its Target; None for MTP tensors skipped."""
    out: dict[str, Target | None] = {}
    for name in ckpt.location:
        if is_scale(name, ckpt.location):
            continue
        target = target_of(name, layout)
        if target is None or (target.internal.startswith("mtp.") and target.internal not in expected):
            if name.startswith("mtp.") and not load_mtp:
                out[name] = None
                continue
            raise WeightLoadError(f"unexpected tensor {name} in {ckpt.location[name].name}")
        if target.internal not in expected:
            raise WeightLoadError(f"unexpected tensor {name} (no parameter {target.internal} in this config)")
        out[name] = target
    return out


def checkpoint_formats(model_dir: str | Path, model: DeepseekV4) -> dict[str, WeightFormat]:
    """The plan load_model(weight_dtype='auto') makes for `model` (a dense meta build of the
    checkpoint's config, with or without MTP), from the shards' headers only."""
    ckpt = Checkpoint(shard_files(Path(model_dir)))
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    targets = _targets(ckpt, detect_layout(list(ckpt.location)), names, load_mtp=len(model.mtp) > 0)
    return stored_formats(model, ckpt, targets)


def load_v4(model_dir: Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", progress: bool = True,
            load_mtp: bool = True, weight_dtype: str = "auto",
            experts: dict[int, list[int]] | None = None) -> DeepseekV4:
    """A DeepSeek-V4 checkpoint (either tensor-name layout) into `DeepseekV4` (see `load_model`)."""
    cfg = ModelConfig.from_model_dir(model_dir)
    ckpt = Checkpoint(shard_files(model_dir))
    layout = detect_layout(list(ckpt.location))
    has_mtp = any(n.startswith("mtp.") for n in ckpt.location)
    model = build_model(cfg, with_mtp=load_mtp and has_mtp and cfg.num_nextn_predict_layers > 0, dtype=dtype)
    targets = _targets(ckpt, layout, {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()},
                       load_mtp)
    configure(model, stored_formats(model, ckpt, targets) if weight_dtype == "auto" else {}, experts)
    _materialize(model, device)
    filler = Filler(model, ckpt)
    # No tqdm at all without a progress bar: even disabled, it creates a multiprocessing lock
    # (a named semaphore) that a worker killed at shutdown would leave behind.
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(targets), desc="loading weights", unit="tensor", leave=False)
    with torch.no_grad():
        for name, target in targets.items():
            filler.fill(name, target)
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    filler.check_complete()
    leftover = set(ckpt.location) - filler.consumed
    if leftover:
        raise WeightLoadError(f"unexpected tensor {sorted(leftover)[0]} (unused scale or extra tensor)")
    model.rope_main.inv_freq = model.rope_main.inv_freq.to(device)
    model.rope_compress.inv_freq = model.rope_compress.inv_freq.to(device)
    model.train(False).requires_grad_(False)  # inference only
    logger.info("loaded %s (%s layout, %d tensors, %.1f MiB read) as %s, weights %s", model_dir, layout, len(targets),
                filler.bytes_read / 2**20, dtype, weight_dtype)
    return model
