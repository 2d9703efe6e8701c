"""Checkpoint tensor names → parameters: what the architectures' name maps share.

A checkpoint tensor maps to a `Target`: the internal parameter name, plus for per-expert tensors
the expert index and which part of the stacked expert tensor it fills (`EXPERT_PARTS`, the
upstream `w1` / `w3` / `w2`). `scale_name_of` lists the names a quantization scale may have.
DeepSeek-V4's layouts: engine/v4/weight_names.py; V4.1's release names: engine/v41/weight_names.py.
"""

from __future__ import annotations

from dataclasses import dataclass

# Upstream expert parts: which rows of the stacked internal tensor each per-expert tensor fills.
EXPERT_PARTS = {"w1": ("ffn.experts.w13.weight", "gate"), "w3": ("ffn.experts.w13.weight", "up"),
                "w2": ("ffn.experts.w2.weight", "all")}


@dataclass(frozen=True)
class Target:
    internal: str  # parameter name in the engine's state dict
    expert: int | None = None  # upstream per-expert tensors: which expert
    part: str | None = None  # 'gate' / 'up' / 'all' rows of the stacked expert tensor


def scale_name_of(weight_name: str) -> list[str]:
    """Names a quantization scale of `weight_name` may have (upstream `.scale`, transformers
    `.weight_scale_inv` / `_scale_inv`)."""
    if weight_name.endswith(".weight"):
        stem = weight_name[: -len(".weight")]
        return [stem + ".scale", stem + ".weight_scale_inv"]
    return [weight_name + "_scale_inv", weight_name + ".scale"]
