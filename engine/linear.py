"""Weight containers of the V4 projections, in the form the checkpoint stores them.

A weight [*lead, N, K] is held in one `WeightFormat`:
  * dense — the compute dtype (or whatever a parameter was built with), `kernels.dense_linear` /
    `kernels.dense_grouped_mm`;
  * fp8   — e4m3 codes [*lead, N, K] plus one scale per (bN × bK) block
    [*lead, ceil(N/bN), ceil(K/bK)] (the release: 128×128, ue8m0);
  * fp4   — e2m1 codes packed two per int8 byte [*lead, N, K/2] (low nibble = even column)
    plus one scale per `group` along K [*lead, N, ceil(K/group)] (the release: 32, ue8m0).
Quantized weights are never dequantized into memory: the `kernels` GEMMs decode them tile by
tile (Triton on GPU, a numba tile decode on CPU). Activations are used as they are (V4 does
not fake-quantize them), so a quantized container computes what the dense container holding
the dequantized weight computes, up to fp32 summation order.

`Linear` is one projection; `GroupedLinear` is wo_a (G independent projections stored as one
[G·O, I] matrix); `RoutedExperts` is a MoE layer's stacked routed experts, of which a rank may
hold any subset (`logical_ids`: the logical expert in each local slot, replicas allowed).
Formats and subsets are set while the model is still on the meta device (`set_format`,
`select`); the loader then allocates and fills the storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

import kernels
from kernels.cpu_precision import bf16_operands
from kernels.model_math import clamped_swiglu

SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32)  # what the kernels read
_CODE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp4": torch.int8}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WeightFormat:
    """How one weight is stored. `block` is (rows, columns) of weight elements per scale:
    (bN, bK) for fp8, (1, group) for fp4, unused for dense."""

    kind: str = "dense"  # 'dense' | 'fp8' | 'fp4'
    block: tuple[int, int] = (1, 1)
    scale_dtype: torch.dtype = torch.float8_e8m0fnu

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "fp8", "fp4"):
            raise ValueError(f"unknown weight format {self.kind!r}")
        if self.kind == "fp4" and (self.block[0] != 1 or self.block[1] % 2):
            raise ValueError(f"fp4 scales cover (1, even group) elements, got {self.block}")
        if self.quantized and self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale dtype {self.scale_dtype} is not one of {SCALE_DTYPES}")

    @classmethod
    def fp8(cls, block: tuple[int, int] = (128, 128), scale_dtype: torch.dtype = torch.float8_e8m0fnu):
        return cls("fp8", (int(block[0]), int(block[1])), scale_dtype)

    @classmethod
    def fp4(cls, group: int = 32, scale_dtype: torch.dtype = torch.float8_e8m0fnu):
        return cls("fp4", (1, int(group)), scale_dtype)

    @property
    def quantized(self) -> bool:
        return self.kind != "dense"

    def stored_shape(self, n: int, k: int) -> tuple[int, int]:
        if self.kind == "fp4":
            if k % 2:
                raise ValueError(f"fp4 packs two values per byte: K={k} must be even")
            return n, k // 2
        return n, k

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        return _cdiv(n, self.block[0]), _cdiv(k, self.block[1])

    def describe(self) -> str:
        if self.kind == "dense":
            return "dense"
        return f"{self.kind} {self.block[0]}x{self.block[1]} {str(self.scale_dtype).removeprefix('torch.')}"


DENSE = WeightFormat()


class QuantWeight(nn.Module):
    """A weight [*lead, N, K] (`out_features` N, `in_features` K) in one format: `weight` holds
    the dense values, the e4m3 codes or the packed e2m1 pairs; `scale` the block scales (None
    when dense)."""

    def __init__(self, in_features: int, out_features: int, lead: tuple[int, ...] = ()):
        super().__init__()
        self.in_features, self.out_features, self.lead = in_features, out_features, tuple(lead)
        self.fmt = DENSE
        self.weight = nn.Parameter(torch.empty(*self.lead, out_features, in_features), requires_grad=False)
        self.register_parameter("scale", None)

    def set_format(self, fmt: WeightFormat, lead: tuple[int, ...] | None = None) -> None:
        """Replace the (uninitialised) storage by `fmt`'s, with `lead` leading dims, on the
        weight's device. A dense weight keeps its dtype (float32 if it was quantized)."""
        lead = self.lead if lead is None else tuple(lead)
        device, n, k = self.weight.device, self.out_features, self.in_features
        if fmt.quantized:
            dtype = _CODE_DTYPES[fmt.kind]
        else:
            dtype = self.weight.dtype if not self.fmt.quantized else torch.float32
        self.weight = nn.Parameter(torch.empty(*lead, *fmt.stored_shape(n, k), dtype=dtype, device=device),
                                   requires_grad=False)
        scale = None
        if fmt.quantized:
            scale = nn.Parameter(torch.empty(*lead, *fmt.scale_shape(n, k), dtype=fmt.scale_dtype, device=device),
                                 requires_grad=False)
        self.scale = scale
        self.fmt, self.lead = fmt, lead

    def __setattr__(self, name: str, value) -> None:
        if name in ("weight", "scale"):
            # A replaced storage drops its preparation at once: the prepared numpy views keep
            # the storage they view alive (packing would otherwise hold the unpacked copies).
            self.__dict__.pop("_cpu_prepared", None)
        super().__setattr__(name, value)

    def cpu_prepared(self, weight: torch.Tensor, scale: torch.Tensor):
        """kernels.prepare_quant_weight of this module's quantized storage (weight and scale as
        given: the storage itself or a view of it), kept until that storage is replaced
        (set_format, packing, a device move); None off CPU. Decode-sized CPU products through it
        cost the kernel, not the generic entry points' per-call checks."""
        cached = self.__dict__.get("_cpu_prepared")
        if cached is not None and cached.views(weight, scale):
            return cached
        cached = kernels.prepare_quant_weight(weight, scale, self.fmt.kind, self.fmt.block)
        self.__dict__["_cpu_prepared"] = cached             # a plain attribute: not state, not a child
        return cached

    @property
    def num_params(self) -> int:
        """Logical weight elements (N·K per leading index), whatever the storage."""
        return math.prod(self.lead) * self.out_features * self.in_features

    def extra_repr(self) -> str:
        lead = f"lead={self.lead}, " if self.lead else ""
        return f"in={self.in_features}, out={self.out_features}, {lead}{self.fmt.describe()}"


class Linear(QuantWeight):
    """y = x W^T for x [..., K] → [..., N], in x's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt.kind == "dense":
            return kernels.dense_linear(x, self.weight)       # bf16 operands where allowed (cpu_gemv)
        flat = x.reshape(-1, x.shape[-1])  # [M, K]
        weight, scale = self.weight, self.scale
        prepared = self.cpu_prepared(weight, scale) if weight.is_cpu else None
        if prepared is not None and prepared.takes(flat):
            out = prepared.linear(flat)  # [M, N] fp32, as the entry points below compute it
        elif self.fmt.kind == "fp8":
            out = kernels.fp8_linear(flat, weight, scale, self.fmt.block)  # [M, N]
        else:
            out = kernels.fp4_linear(flat, weight, scale, group=self.fmt.block[1])
        return out.view(*x.shape[:-1], self.out_features)


class GroupedLinear(Linear):
    """G independent projections (V4's grouped wo_a) stored as one [G·O, I] weight:
    x [T, G, I] → [T, G, O], group g using rows [g·O, (g+1)·O)."""

    def __init__(self, groups: int, in_per_group: int, out_per_group: int):
        super().__init__(in_per_group, groups * out_per_group)
        self.groups, self.out_per_group = groups, out_per_group

    def supports(self, fmt: WeightFormat) -> bool:
        """A quantized format must not put one scale row across two groups."""
        return not fmt.quantized or self.out_per_group % fmt.block[0] == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, o = self.groups, self.out_per_group
        if self.fmt.kind == "dense":
            with bf16_operands(x.numel() * o):                   # T·G·I·O
                return torch.einsum("tgi,goi->tgo", x, self.weight.view(g, o, -1))
        t = x.shape[0]
        rows = x.transpose(0, 1).reshape(g * t, x.shape[-1])  # [G·T, I], group-major: one "expert" per group
        ends = torch.arange(1, g + 1, dtype=torch.int32, device=x.device) * t  # [G] cumulative row ends
        weight = self.weight.view(g, o, -1)  # [G, O, I or I/2]
        scale = self.scale.view(g, -1, self.scale.shape[-1])  # [G, O/bN, ...]
        prepared = self.cpu_prepared(weight, scale) if weight.is_cpu else None
        if prepared is not None and prepared.takes(rows):
            out = prepared.grouped(rows, ends)  # [G·T, O] fp32
        elif self.fmt.kind == "fp8":
            out = kernels.fp8_grouped_mm(rows, weight, scale, ends, self.fmt.block)  # [G·T, O]
        else:
            out = kernels.fp4_grouped_mm(rows, weight, scale, ends, group=self.fmt.block[1])
        return out.view(g, t, o).transpose(0, 1)


class GroupedWeight(QuantWeight):
    """One weight per local expert slot: [L, N, K] (or its stored form)."""

    def __init__(self, num_slots: int, in_features: int, out_features: int):
        super().__init__(in_features, out_features, (num_slots,))

    def grouped_mm(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Rows [ends[s-1], ends[s]) of x [S, K] through slot s: → [S, N]; ends int32 [L]."""
        if self.fmt.kind == "dense":
            return kernels.dense_grouped_mm(x, self.weight, ends)  # CUDA: capturable for every dtype
        weight, scale = self.weight, self.scale
        prepared = self.cpu_prepared(weight, scale) if weight.is_cpu else None
        if prepared is not None and prepared.takes(x) and ends.is_cpu:
            return prepared.grouped(x, ends)  # fp32, as the entry points below compute it
        if self.fmt.kind == "fp8":
            return kernels.fp8_grouped_mm(x, weight, scale, ends, self.fmt.block)
        return kernels.fp4_grouped_mm(x, weight, scale, ends, group=self.fmt.block[1])

    def relayout(self) -> None:
        """On CPU a dense stack is stored so that its [L, K, N] transpose is contiguous (what CPU
        grouped_mm is fast on); on GPU it stays row-major, whose transpose is the column-major
        operand cuBLAS wants. Quantized stacks stay row-major (what the kernels read)."""
        w = self.weight
        if self.fmt.kind == "dense" and w.device.type == "cpu":
            self.weight = nn.Parameter(w.transpose(1, 2).contiguous().transpose(1, 2), requires_grad=False)


class RoutedExperts(nn.Module):
    """The routed experts of one MoE layer that this rank holds: clamped-SwiGLU MLPs with
    w13 [L, 2I, H] (gate rows, then up rows) and w2 [L, H, I], one slot per local expert.

    `logical_ids[s]` is the logical expert in slot s. One rank (no expert parallelism) holds
    every expert in order; under EP a rank holds its share, replicas included."""

    def __init__(self, num_experts: int, hidden: int, inter: int, swiglu_limit: float):
        super().__init__()
        self.num_experts, self.hidden, self.inter, self.swiglu_limit = num_experts, hidden, inter, swiglu_limit
        self.logical_ids: tuple[int, ...] = tuple(range(num_experts))
        self.w13 = GroupedWeight(num_experts, hidden, 2 * inter)
        self.w2 = GroupedWeight(num_experts, inter, hidden)

    @property
    def num_local_experts(self) -> int:
        return len(self.logical_ids)

    @property
    def holds_all(self) -> bool:
        """Every logical expert, expert e in slot e (what `MoE._experts` routes to directly)."""
        return self.logical_ids == tuple(range(self.num_experts))

    @property
    def fmt(self) -> WeightFormat:
        return self.w13.fmt

    def select(self, logical_ids: list[int] | tuple[int, ...]) -> None:
        """Hold these logical experts, one slot each in this order (storage uninitialised)."""
        ids = tuple(int(e) for e in logical_ids)
        bad = [e for e in ids if not 0 <= e < self.num_experts]
        if bad:
            raise ValueError(f"expert ids {bad} are outside [0, {self.num_experts})")
        self.logical_ids = ids
        for w in (self.w13, self.w2):
            w.set_format(w.fmt, (len(ids),))

    def set_format(self, fmt: WeightFormat) -> None:
        for w in (self.w13, self.w2):
            w.set_format(fmt)

    def slots_of(self, expert: int) -> list[int]:
        """Local slots holding logical `expert` (empty when this rank does not hold it)."""
        return [s for s, e in enumerate(self.logical_ids) if e == expert]

    def forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x [S, H] sorted by local slot, ends int32 [L] cumulative row ends → [S, H]."""
        h = self.w13.grouped_mm(x, ends)  # [S, 2I]
        act = clamped_swiglu(h[:, : self.inter], h[:, self.inter :], self.swiglu_limit)  # [S, I]
        return self.w2.grouped_mm(act, ends)  # [S, H]

    def local_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """ExpertParallelMoE's `local_experts`: x [S, H] sorted by slot, counts [L] rows per slot."""
        return self(x, counts.cumsum(0).to(torch.int32))

    def adopt(self, tensors: dict[str, torch.Tensor], logical_ids: list[int] | tuple[int, ...]) -> None:
        """Take new slot tensors (this module's state_dict names, [L', ...] each, e.g. after an
        EPLB migration) holding `logical_ids`."""
        ids = tuple(int(e) for e in logical_ids)
        for name, w in (("w13", self.w13), ("w2", self.w2)):
            w.weight = nn.Parameter(tensors[f"{name}.weight"], requires_grad=False)
            if w.scale is not None:
                w.scale = nn.Parameter(tensors[f"{name}.scale"], requires_grad=False)
            w.lead = (len(ids),)
            w.relayout()
        self.logical_ids = ids

    def extra_repr(self) -> str:
        return f"experts={self.num_local_experts}/{self.num_experts}, {self.fmt.describe()}"
