"""Weight containers of the V4.1 model and the three GEMM kinds on them.

`Param` holds one tensor as `.weight` (and an optional `.bias`), so module paths spell the
release's tensor names (`layers.3.attn.q_norm.weight`). `QLinear` is engine/linear.py's
`Linear` (FP8 codes + E8M0 block scales as stored, or dense values when upcast at load) whose
product is V4.1's: act_quant then the exact block GEMM (numerics.quant_gemm_exact), or the
kernels' fp32-accumulated GEMM in fast numerics. A stored weight is decoded once, on first use,
into an fp64 copy held beside the module (not a parameter): the exact GEMM reads it.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels

from ..linear import Linear, QuantWeight, RoutedExperts
from . import numerics as nx
from .quant import fake_fp8


def stored_values(w: QuantWeight, index: int | None = None) -> torch.Tensor:
    """The exact fp32 values of a container's weight (slot `index` of a stack)."""
    weight = w.weight if index is None else w.weight[index]
    if not w.fmt.quantized:
        return weight.float()
    scale = w.scale if index is None else w.scale[index]
    if w.fmt.kind == "fp8":
        return kernels.reference.dequantize_fp8_weight(weight, scale, w.fmt.block)
    return kernels.reference.dequantize_fp4_weight(weight, scale, w.fmt.block[1])


class Param(nn.Module):
    """One named tensor (`weight`), optionally with a `bias`, in a fixed dtype."""

    def __init__(self, *shape: int, dtype: torch.dtype = torch.bfloat16, bias: int | None = None,
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        if bias is not None:
            self.bias = nn.Parameter(torch.empty(bias, dtype=bias_dtype), requires_grad=False)


class QLinear(Linear):
    """An FP8-stored projection [out, in]: forward = act_quant(x) then the exact block GEMM."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.bfloat16), requires_grad=False)
        self._f64: torch.Tensor | None = None

    def values64(self) -> torch.Tensor:
        if self._f64 is None or self._f64.device != self.weight.device:
            self._f64 = stored_values(self).double()
        return self._f64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if nx.current().exact:
            return nx.quant_gemm_exact(x, self.values64())
        return fast_quant_gemm(x, self)

    def bf16_values(self) -> torch.Tensor:
        """The weight as bf16 (exact: e4m3 × a power of two fits bf16) — wo_a's einsum."""
        return stored_values(self).to(torch.bfloat16)


def fast_quant_gemm(x: torch.Tensor, w: QuantWeight, index: int | None = None) -> torch.Tensor:
    """The kernels' FP8/FP4 GEMM with activation quantization, fp32 accumulation → bf16."""
    flat = x.reshape(-1, x.shape[-1])
    weight = w.weight if index is None else w.weight[index]
    if w.fmt.kind == "fp8":
        scale = w.scale if index is None else w.scale[index]
        out = kernels.fp8_linear(flat, weight, scale, w.fmt.block, act_quant=True, out_dtype=torch.bfloat16)
    elif w.fmt.kind == "fp4":
        scale = w.scale if index is None else w.scale[index]
        out = kernels.fp4_linear(flat, weight, scale, act_quant=True, out_dtype=torch.bfloat16, group=w.fmt.block[1])
    else:
        out = torch.nn.functional.linear(fake_fp8(flat).float(), weight.float()).to(torch.bfloat16)
    return out.view(*x.shape[:-1], -1)


class V41Experts(RoutedExperts):
    """engine/linear.py's expert stack (w13 = [gate rows; up rows], w2), computed V4.1's way:
    exact block GEMMs, clamped SwiGLU in fp32, the routing weight applied before w2."""

    def __init__(self, num_experts: int, hidden: int, inter: int, swiglu_limit: float):
        super().__init__(num_experts, hidden, inter, swiglu_limit)
        self._f64: dict[tuple[int, int], torch.Tensor] = {}

    def _values64(self, which: int, slot: int) -> torch.Tensor:
        key = (which, slot)
        if key not in self._f64:
            self._f64[key] = stored_values(self.w13 if which == 13 else self.w2, slot).double()
        return self._f64[key]

    def run(self, slot: int, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Local slot's expert on x [n, H] bf16 (routing weight [n, 1] fp32 or None) → [n, H] bf16."""
        exact, limit = nx.current().exact, self.swiglu_limit
        h = nx.quant_gemm_exact(x, self._values64(13, slot)) if exact else fast_quant_gemm(x, self.w13, slot)
        gate = h[:, :self.inter].float().clamp(max=limit)
        up = h[:, self.inter:].float().clamp(-limit, limit)
        act = nx.silu(gate) * up
        if weight is not None:
            act = weight * act
        act = act.to(torch.bfloat16)
        return nx.quant_gemm_exact(act, self._values64(2, slot)) if exact else fast_quant_gemm(act, self.w2, slot)

    def adopt(self, tensors, logical_ids) -> None:
        super().adopt(tensors, logical_ids)
        self._f64.clear()

    def select(self, logical_ids) -> None:
        super().select(logical_ids)
        self._f64.clear()
