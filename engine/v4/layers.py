"""Stateless building blocks of DeepSeek-V4: norms, interleaved RoPE (plain and YaRN), mHC.

The maths is kernels/model_math.py's (written once for V4 and V4.1; V4's variants where their
roundings differ); this module adds the rotary table and keeps the names the V4 model imports.
Reductions that the model defines in fp32 (RMSNorm statistics, RoPE rotation, mHC mixing
weights) are done in fp32 whatever the compute dtype.
"""

from __future__ import annotations

import torch

from kernels.model_math import (apply_rope, clamped_swiglu, hc_collapse, hc_expand,
                                hc_head_collapse, hc_mix_weights, head_rms_norm, rms_norm, yarn_inv_freq)

from ..config import YarnParams


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnParams | None) -> torch.Tensor:
    """Inverse frequencies, one per interleaved channel pair: [rope_dim // 2], fp32 (V4's YaRN
    rounding, as transformers; attention scaling fixed at 1.0)."""
    return yarn_inv_freq(rope_dim, theta, yarn, quotient=False)


class RotaryTable:
    """cos/sin lookup for integer positions, computed on demand in fp32 (no max-length table)."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnParams | None, device: torch.device | str = "cpu"):
        self.inv_freq = rope_inv_freq(rope_dim, theta, yarn).to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, rope_dim/2]
        return freqs.cos(), freqs.sin()


__all__ = ["RotaryTable", "apply_rope", "clamped_swiglu", "hc_collapse", "hc_expand", "hc_head_collapse",
           "hc_mix_weights", "head_rms_norm", "rms_norm", "rope_inv_freq"]
