"""Load a Hugging Face-format DeepSeek-V4 directory into `DeepseekV4`.

Reads `config.json`, sharded safetensors (with `model.safetensors.index.json`) or one file,
in the upstream or the transformers tensor layout, and decodes quantized weights into the
compute dtype:
  * FP8 e4m3 with one ue8m0 (or fp32) scale per block (`.scale` / `.weight_scale_inv`);
  * FP4 e2m1 packed two per int8 byte (low nibble = even column) with one ue8m0 scale per 32
    columns (routed experts, `expert_dtype: fp4`).
Every parameter must be filled exactly once with the right shape; anything else is a
`WeightLoadError` that names the tensor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from .config import ModelConfig
from .model import DeepseekV4
from .mtp import MTPLayer
from .weight_names import Target, detect_layout, scale_name_of, target_of

logger = logging.getLogger(__name__)

# e2m1 code → value; bit 3 is the sign.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Parameter leaves the model defines in fp32, kept so whatever the compute dtype.
_FP32_LEAVES = frozenset({"norm", "q_norm", "kv_norm", "attn_norm", "ffn_norm", "enorm", "hnorm", "fn", "base",
                          "scale", "attn_sink", "ape", "gate_bias"})


class WeightLoadError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the tensor or file."""


def keeps_fp32(internal: str) -> bool:
    return internal.rpartition(".")[2] in _FP32_LEAVES


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise WeightLoadError(f"{index}: malformed index ({exc})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{model_dir}: no .safetensors files")
    for f in files:
        if not f.exists():
            raise WeightLoadError(f"{f}: listed in the index but missing")
    return files


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [R, C] with a block scale grid [ceil(R/bR), ceil(C/bC)] → fp32 [R, C]."""
    rows, cols = weight.shape[-2:]
    srows, scols = scale.shape[-2:]
    block_r, block_c = -(-rows // srows), -(-cols // scols)
    s = _scale_fp32(scale)
    s = s.repeat_interleave(block_r, dim=-2)[..., :rows, :].repeat_interleave(block_c, dim=-1)[..., :cols]
    return weight.float() * s


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [R, C/2] of e2m1 pairs (low nibble = even column) → fp32 [R, C]."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    u8 = packed.view(torch.uint8).long()
    return torch.stack((lut[u8 & 0xF], lut[u8 >> 4]), dim=-1).flatten(-2)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    values = unpack_fp4(packed)
    block = values.shape[-1] // scale.shape[-1]
    return values * _scale_fp32(scale).repeat_interleave(block, dim=-1)


def _scale_fp32(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:  # raw ue8m0 exponent bytes
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


class _Checkpoint:
    """Lazy access to every tensor of the shards by name."""

    def __init__(self, files: list[Path]):
        self.location: dict[str, Path] = {}
        self.handles = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise WeightLoadError(f"{f.name}: cannot read safetensors file ({exc})") from None
            self.handles[f] = handle
            for name in handle.keys():
                if name in self.location:
                    raise WeightLoadError(f"tensor {name} appears in both {self.location[name].name} and {f.name}")
                self.location[name] = f

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.handles[self.location[name]].get_tensor(name)
        except SafetensorError as exc:
            raise WeightLoadError(f"{self.location[name].name}: tensor {name} is unreadable ({exc})") from None


def _decode(ckpt: _Checkpoint, name: str, consumed: set[str]) -> torch.Tensor:
    tensor = ckpt.get(name)
    consumed.add(name)
    scale_name = next((s for s in scale_name_of(name) if s in ckpt.location), None)
    if scale_name is None:
        if tensor.dtype in (torch.float8_e4m3fn, torch.int8) and not name.endswith("tid2eid"):
            raise WeightLoadError(f"tensor {name} is quantized ({tensor.dtype}) but has no scale tensor")
        return tensor
    consumed.add(scale_name)
    scale = ckpt.get(scale_name)
    if tensor.dtype == torch.int8:
        if tensor.shape[-1] * 2 % scale.shape[-1]:
            raise WeightLoadError(f"tensor {name}: FP4 scale shape {tuple(scale.shape)} does not tile {tuple(tensor.shape)}")
        return dequantize_fp4(tensor, scale)
    if tensor.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(tensor, scale)
    raise WeightLoadError(f"tensor {name} has a scale but dtype {tensor.dtype} is not FP8/FP4")


def build_model(cfg: ModelConfig, with_mtp: bool) -> DeepseekV4:
    with torch.device("meta"):
        model = DeepseekV4(cfg)
        if with_mtp:
            model.mtp.extend(MTPLayer(cfg, i) for i in range(cfg.num_nextn_predict_layers))
    return model


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
               progress: bool = True, load_mtp: bool = True) -> DeepseekV4:
    """Build the model described by `model_dir/config.json` and fill it from its safetensors."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_model_dir(model_dir)
    ckpt = _Checkpoint(shard_files(model_dir))
    layout = detect_layout(list(ckpt.location))
    has_mtp = any(n.startswith("mtp.") for n in ckpt.location)
    model = build_model(cfg, with_mtp=load_mtp and has_mtp and cfg.num_nextn_predict_layers > 0)
    expected = {name: p for name, p in list(model.named_parameters()) + list(model.named_buffers())}
    filled: dict[str, torch.Tensor] = {}
    expert_rows: dict[str, set[tuple[int, str]]] = {}
    consumed: set[str] = set()
    weight_names = [n for n in ckpt.location if not _is_scale(n, ckpt.location)]
    # No tqdm at all without a progress bar: even disabled, it creates a multiprocessing lock
    # (a named semaphore) that a worker killed at shutdown would leave behind.
    names = tqdm(weight_names, desc="loading weights", unit="tensor", leave=False) if progress else weight_names
    for name in names:
        target = target_of(name, layout)
        if target is None or (target.internal.startswith("mtp.") and target.internal not in expected):
            if name.startswith("mtp.") and not load_mtp:
                consumed.add(name)
                continue
            raise WeightLoadError(f"unexpected tensor {name} in {ckpt.location[name].name}")
        if target.internal not in expected:
            raise WeightLoadError(f"unexpected tensor {name} (no parameter {target.internal} in this config)")
        value = _decode(ckpt, name, consumed)
        _place(filled, expert_rows, expected[target.internal], target, value, name, cfg, dtype)
    _check_complete(expected, filled, expert_rows, cfg)
    leftover = set(ckpt.location) - consumed
    if leftover:
        raise WeightLoadError(f"unexpected tensor {sorted(leftover)[0]} (unused scale or extra tensor)")
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, value in filled.items():
            _assign(model, name, value, device)
    model.rope_main.inv_freq = model.rope_main.inv_freq.to(device)
    model.rope_compress.inv_freq = model.rope_compress.inv_freq.to(device)
    model.train(False).requires_grad_(False)  # inference only
    logger.info("loaded %s (%s layout, %d tensors) as %s", model_dir, layout, len(weight_names), dtype)
    return model


def _is_scale(name: str, names: dict[str, Path]) -> bool:
    for suffix, weight_suffix in ((".scale", ".weight"), (".weight_scale_inv", ".weight")):
        if name.endswith(suffix) and name[: -len(suffix)] + weight_suffix in names:
            return True
    return name.endswith("_scale_inv") and name[: -len("_scale_inv")] in names


def _target_dtype(internal: str, param: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    if not param.dtype.is_floating_point:
        return param.dtype
    return torch.float32 if keeps_fp32(internal) else dtype


def _place(filled, expert_rows, param, target: Target, value: torch.Tensor, name: str, cfg: ModelConfig,
           dtype: torch.dtype) -> None:
    want = _target_dtype(target.internal, param, dtype)
    if target.expert is None:
        if target.internal in filled:
            raise WeightLoadError(f"tensor {name}: parameter {target.internal} filled twice")
        if tuple(value.shape) != tuple(param.shape):
            raise WeightLoadError(f"tensor {name} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        filled[target.internal] = value.to(want)
        return
    inter = cfg.moe_intermediate_size
    rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "all": slice(None)}[target.part]
    expect = tuple(param.shape[1:]) if target.part == "all" else (inter, param.shape[2])
    if tuple(value.shape) != expect:
        raise WeightLoadError(f"tensor {name} has shape {tuple(value.shape)}, expected {expect}")
    if target.expert >= param.shape[0]:
        raise WeightLoadError(f"tensor {name}: expert {target.expert} ≥ n_routed_experts {param.shape[0]}")
    key = (target.expert, target.part)
    seen = expert_rows.setdefault(target.internal, set())
    if key in seen:
        raise WeightLoadError(f"tensor {name}: expert weight given twice")
    seen.add(key)
    stacked = filled.setdefault(target.internal, torch.empty(param.shape, dtype=want))
    stacked[target.expert, rows] = value.to(want)


def _check_complete(expected, filled, expert_rows, cfg: ModelConfig) -> None:
    for internal, param in expected.items():
        if internal not in filled:
            raise WeightLoadError(f"missing tensor for parameter {internal} (shape {tuple(param.shape)})")
        if internal in expert_rows:
            parts = ("gate", "up") if internal.endswith("w13") else ("all",)
            for e in range(cfg.n_routed_experts):
                for p in parts:
                    if (e, p) not in expert_rows[internal]:
                        raise WeightLoadError(f"missing tensor for expert {e} of {internal} ({p} rows)")


def _assign(model: torch.nn.Module, internal: str, value: torch.Tensor, device: str) -> None:
    module_name, _, attr = internal.rpartition(".")
    value = value.to(device)
    if attr in ("w13", "w2") and value.device.type == "cpu":
        value = value.transpose(1, 2).contiguous().transpose(1, 2)  # see engine/moe.py
    module = model.get_submodule(module_name) if module_name else model
    current = getattr(module, attr)
    if isinstance(current, torch.nn.Parameter):
        setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))
    else:
        module.register_buffer(attr, value)
