"""Safetensors checkpoints into a model, for every architecture.

`load_model` is the entry: the architecture that `config.json` names (engine/models/) builds its
model and fills it (DeepSeek-V4: engine/v4/weights.py, V4.1: engine/v41/weights.py). What they
share is here: the shards (`Checkpoint`, lazy by tensor name, headers read without the data),
FP8 / FP4 decoding (the upcast), the plan of which weight containers keep their stored format
(`stored_formats`), and `Filler`, which copies tensors into an allocated model and checks that
every parameter is filled exactly once with the right shape (`WeightLoadError` names the tensor).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .config import WEIGHT_DTYPES, ModelConfig
from .linear import DENSE, SCALE_DTYPES, GroupedLinear, GroupedWeight, QuantWeight, RoutedExperts, WeightFormat
from .models import registry
from .weight_names import Target, scale_name_of


# e2m1 code → value; bit 3 is the sign.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# safetensors header dtype names → torch dtypes (what `Checkpoint.info` reports).
_ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
              "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
              "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
              "BOOL": torch.bool}
_PART_ROWS = ("gate", "up")  # expert parts that fill one half of w13's rows


class WeightLoadError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the tensor or file."""


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


# ---- decoding (the upcast) ---------------------------------------------------------------


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [..., R, C] with a block scale grid [..., ceil(R/bR), ceil(C/bC)] → fp32 [..., R, C]."""
    rows, cols = weight.shape[-2:]
    srows, scols = scale.shape[-2:]
    block_r, block_c = -(-rows // srows), -(-cols // scols)
    s = _scale_fp32(scale)
    s = s.repeat_interleave(block_r, dim=-2)[..., :rows, :].repeat_interleave(block_c, dim=-1)[..., :cols]
    return weight.float() * s


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., R, C/2] of e2m1 pairs (low nibble = even column) → fp32 [..., R, C]."""
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


def _dequantized(name: str, value: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A stored tensor (and its scale) as plain values: FP8/FP4 decoded to fp32."""
    if scale is None:
        if value.dtype in (torch.float8_e4m3fn, torch.int8) and not name.endswith("tid2eid"):
            raise WeightLoadError(f"tensor {name} is quantized ({value.dtype}) but has no scale tensor")
        return value
    if value.dtype == torch.int8:
        if value.shape[-1] * 2 % scale.shape[-1]:
            raise WeightLoadError(f"tensor {name}: FP4 scale shape {tuple(scale.shape)} does not tile {tuple(value.shape)}")
        return dequantize_fp4(value, scale)
    if value.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(value, scale)
    raise WeightLoadError(f"tensor {name} has a scale but dtype {value.dtype} is not FP8/FP4")


# ---- the shards --------------------------------------------------------------------------


class Checkpoint:
    """Lazy access to every tensor of the shards by name: `info` reads only the header."""

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

    def _handle(self, name: str):
        return self.handles[self.location[name]]

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle(name).get_tensor(name)
        except SafetensorError as exc:
            raise WeightLoadError(f"{self.location[name].name}: tensor {name} is unreadable ({exc})") from None

    def get_row(self, name: str, index: int) -> torch.Tensor:
        """tensor[index] of a stacked tensor, reading only that slice."""
        try:
            return self._handle(name).get_slice(name)[index : index + 1][0]
        except SafetensorError as exc:
            raise WeightLoadError(f"{self.location[name].name}: tensor {name} is unreadable ({exc})") from None

    def info(self, name: str) -> tuple[torch.dtype | None, tuple[int, ...]]:
        """(dtype, shape) from the header, without reading the data."""
        piece = self._handle(name).get_slice(name)
        return _ST_DTYPES.get(piece.get_dtype()), tuple(piece.get_shape())

    def scale_of(self, name: str) -> str | None:
        return next((s for s in scale_name_of(name) if s in self.location), None)


def is_scale(name: str, names: dict[str, Path]) -> bool:
    for suffix, weight_suffix in ((".scale", ".weight"), (".weight_scale_inv", ".weight")):
        if name.endswith(suffix) and name[: -len(suffix)] + weight_suffix in names:
            return True
    return name.endswith("_scale_inv") and name[: -len("_scale_inv")] in names


# ---- planning ----------------------------------------------------------------------------


def _container(model: nn.Module, internal: str) -> QuantWeight | None:
    path, _, leaf = internal.rpartition(".")
    module = model.get_submodule(path) if path and leaf == "weight" else None
    return module if isinstance(module, QuantWeight) else None


def stored_formats(model: nn.Module, ckpt: Checkpoint, targets: dict[str, Target | None]) -> dict[str, WeightFormat]:
    """Module path → format of every weight container the checkpoint stores quantized (what
    weight_dtype='auto' keeps), from the tensors' headers."""
    seen: dict[str, tuple[WeightFormat, str]] = {}
    for name, target in targets.items():
        module = _container(model, target.internal) if target is not None else None
        if module is None:
            continue
        fmt = _stored_format(ckpt, name, module, target)
        path = target.internal.rpartition(".")[0]
        first = seen.setdefault(path, (fmt, name))
        if first[0] != fmt:
            raise WeightLoadError(f"tensor {name} is stored as {fmt.describe()} but {first[1]} of the same weight "
                                  f"as {first[0].describe()}")
    return {path: fmt for path, (fmt, _) in seen.items() if fmt.quantized}


def _stored_format(ckpt: Checkpoint, name: str, module: QuantWeight, target: Target) -> WeightFormat:
    """The format `name` is stored in, or DENSE where the container cannot keep it (it is then
    decoded at load)."""
    scale_name = ckpt.scale_of(name)
    if scale_name is None:
        return DENSE
    dtype, _ = ckpt.info(name)
    scale_dtype, scale_shape = ckpt.info(scale_name)
    if len(scale_shape) < 2:
        return DENSE
    rows = module.out_features // 2 if target.part in _PART_ROWS else module.out_features
    k = module.in_features
    scale_dtype = scale_dtype if scale_dtype in SCALE_DTYPES else torch.float32
    if dtype == torch.float8_e4m3fn:
        block = (-(-rows // scale_shape[-2]), -(-k // scale_shape[-1]))
        if target.part in _PART_ROWS and rows % block[0]:
            return DENSE  # the gate and up halves' scale rows would not tile the stacked scale
        fmt = WeightFormat.fp8(block, scale_dtype)
    elif dtype == torch.int8:
        group = -(-k // scale_shape[-1])
        if group % 2:
            return DENSE
        fmt = WeightFormat.fp4(group, scale_dtype)
    else:
        return DENSE
    if isinstance(module, GroupedLinear) and not module.supports(fmt):
        return DENSE
    return fmt


# ---- filling -----------------------------------------------------------------------------


class Filler:
    """Copies checkpoint tensors into an allocated model and keeps the books: what was filled,
    which expert rows, which checkpoint tensors were consumed (read or deliberately skipped)."""

    def __init__(self, model: nn.Module, ckpt: Checkpoint, adopt: frozenset[str] = frozenset()):
        """adopt: paths of quantized CPU containers whose stored tensors become their parameters
        as read, with no copy. safetensors maps the file, so those parameters are the page cache's
        pages, shared by every process on the host that loads the same file (read-only use)."""
        self.model, self.ckpt, self.cfg = model, ckpt, model.cfg
        self.adopt = adopt
        self.params = dict(list(model.named_parameters()) + list(model.named_buffers()))
        self.filled: set[str] = set()
        self.expert_parts: dict[tuple[int, int], set[str]] = {}  # (id of the stack, slot) → parts
        self.consumed: set[str] = set()
        self.bytes_read = 0

    def _consume(self, name: str) -> str | None:
        self.consumed.add(name)
        scale_name = self.ckpt.scale_of(name)
        if scale_name is not None:
            self.consumed.add(scale_name)
        return scale_name

    def _read(self, name: str, row: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        scale_name = self._consume(name)
        get = self.ckpt.get if row is None else (lambda n: self.ckpt.get_row(n, row))  # noqa: E731
        value = get(name)
        scale = get(scale_name) if scale_name is not None else None
        self.bytes_read += value.nbytes + (scale.nbytes if scale is not None else 0)
        return value, scale

    def fill(self, name: str, target: Target | None) -> None:
        if target is None:
            self._consume(name)
            return
        container = _container(self.model, target.internal)
        if isinstance(container, GroupedWeight):
            self._fill_experts(name, target, container)
            return
        value, scale = self._read(name)
        if target.internal in self.filled:
            raise WeightLoadError(f"tensor {name}: parameter {target.internal} filled twice")
        adopt = target.internal.rpartition(".")[0] in self.adopt
        if container is not None and container.fmt.quantized and adopt and self._adoptable(container, value, scale):
            self._adopt_quantized(container, value, scale)
        elif container is not None and container.fmt.quantized:
            self._store_quantized(name, container, (), value, scale)
        else:
            self._store_dense(name, self.params[target.internal], value, scale)
        self.filled.add(target.internal)

    @staticmethod
    def _store_dense(name: str, dst: torch.Tensor, value: torch.Tensor, scale: torch.Tensor | None) -> None:
        value = _dequantized(name, value, scale)
        if tuple(value.shape) != tuple(dst.shape):
            raise WeightLoadError(f"tensor {name} has shape {tuple(value.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(value)

    @staticmethod
    def _store_quantized(name: str, w: QuantWeight, index: tuple, value: torch.Tensor,
                         scale: torch.Tensor | None, scale_index: tuple | None = None) -> None:
        """The stored codes and scale as they are into w.weight[index] / w.scale[scale_index]."""
        if scale is None or value.dtype != w.weight.dtype:
            raise WeightLoadError(f"tensor {name} ({value.dtype}) does not match its planned format {w.fmt.describe()}")
        dst, sdst = w.weight[index], w.scale[index if scale_index is None else scale_index]
        if tuple(value.shape) != tuple(dst.shape):
            raise WeightLoadError(f"tensor {name} has shape {tuple(value.shape)}, expected {tuple(dst.shape)}")
        if tuple(scale.shape) != tuple(sdst.shape):
            raise WeightLoadError(f"tensor {name}: scale shape {tuple(scale.shape)}, expected {tuple(sdst.shape)}")
        dst.copy_(value)
        sdst.copy_(scale)

    @staticmethod
    def _adoptable(w: QuantWeight, value: torch.Tensor, scale: torch.Tensor | None) -> bool:
        """The stored tensors can stand as w's parameters: same dtypes and shapes, on the CPU."""
        return (scale is not None and w.weight.device.type == "cpu" and value.dtype == w.weight.dtype
                and scale.dtype == w.scale.dtype and value.shape == w.weight.shape and scale.shape == w.scale.shape)

    @staticmethod
    def _adopt_quantized(w: QuantWeight, value: torch.Tensor, scale: torch.Tensor) -> None:
        w.weight = nn.Parameter(value, requires_grad=False)
        w.scale = nn.Parameter(scale, requires_grad=False)

    def _fill_experts(self, name: str, target: Target, w: GroupedWeight) -> None:
        experts: RoutedExperts = self.model.get_submodule(target.internal.rsplit(".", 2)[0])
        if target.expert is None:  # one stacked tensor [E, N, K] (transformers layout)
            _, shape = self.ckpt.info(name)
            if not shape or shape[0] != experts.num_experts:
                raise WeightLoadError(f"tensor {name} has shape {shape}, expected {experts.num_experts} experts first")
            if experts.holds_all:
                self._store_expert(name, w, slice(None), "all", *self._read(name))
                return
            self._consume(name)
            for e in sorted(set(experts.logical_ids)):
                value, scale = self._read(name, row=e)
                for slot in experts.slots_of(e):
                    self._store_expert(name, w, slot, "all", value, scale)
            return
        if target.expert >= experts.num_experts:
            raise WeightLoadError(f"tensor {name}: expert {target.expert} ≥ n_routed_experts {experts.num_experts}")
        slots = experts.slots_of(target.expert)
        if not slots:  # another rank's expert: never read
            self._consume(name)
            return
        value, scale = self._read(name)
        for slot in slots:
            self._store_expert(name, w, slot, target.part, value, scale)

    def _store_expert(self, name: str, w: GroupedWeight, slot: int | slice, part: str, value: torch.Tensor,
                      scale: torch.Tensor | None) -> None:
        inter = self.cfg.moe_intermediate_size
        rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "all": slice(None)}[part]
        slots = range(w.lead[0]) if isinstance(slot, slice) else [slot]
        for s in slots:
            have = self.expert_parts.setdefault((id(w), s), set())
            if part in have or "all" in have or (part == "all" and have):
                raise WeightLoadError(f"tensor {name}: expert weight given twice")
            have.add(part)
        if w.fmt.quantized:
            block = w.fmt.block[0]
            srows = slice(rows.start // block, rows.stop // block) if part in _PART_ROWS else slice(None)
            self._store_quantized(name, w, (slot, rows), value, scale, (slot, srows))
        else:
            self._store_dense(name, w.weight[slot, rows], value, scale)

    def check_complete(self) -> None:
        containers = {f"{path}.scale": m for path, m in self.model.named_modules() if isinstance(m, QuantWeight)}
        for internal, param in self.params.items():
            if internal in containers:
                continue  # filled with its weight
            w = _container(self.model, internal)
            if isinstance(w, GroupedWeight):
                self._check_experts(internal, w)
            elif internal not in self.filled:
                raise WeightLoadError(f"missing tensor for parameter {internal} (shape {tuple(param.shape)})")

    def _check_experts(self, internal: str, w: GroupedWeight) -> None:
        experts: RoutedExperts = self.model.get_submodule(internal.rsplit(".", 2)[0])
        wanted = ("gate", "up") if w is experts.w13 else ("all",)
        for slot, logical in enumerate(experts.logical_ids):
            have = self.expert_parts.get((id(w), slot), set())
            for part in wanted:
                if part not in have and "all" not in have:
                    raise WeightLoadError(f"missing tensor for expert {logical} of {internal} ({part} rows)")


# ---- loading -----------------------------------------------------------------------------


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
               progress: bool = True, load_mtp: bool = True, weight_dtype: str = "auto",
               experts: dict[int, list[int]] | None = None, engram_tables: str = "device",
               language_model_only: bool = False) -> nn.Module:
    """Build the model described by `model_dir/config.json` and fill it from its safetensors.

    dtype: the compute dtype. weight_dtype: 'auto' keeps FP8/FP4 weights as stored, 'bf16'
    decodes them into `dtype` (the upcast). experts: MoE layer id → the logical experts this
    rank holds (see `build_model`); None holds all. engram_tables: where a V4.1 model keeps its
    Engram tables, 'device' or 'host' (V4 has none). language_model_only: a V4.1 checkpoint's
    vision tower is neither built nor read (V4 has none)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    model_dir = Path(model_dir)
    arch = registry.of(ModelConfig.from_model_dir(model_dir))  # the architecture builds and fills its model
    model = arch.load_model(model_dir, dtype=dtype, device=device, progress=progress, load_mtp=load_mtp,
                            weight_dtype=weight_dtype, experts=experts, engram_tables=engram_tables,
                            language_model_only=language_model_only)
    model.source_dir = model_dir  # where its tokenizer is (structured outputs compile against it)
    return model
