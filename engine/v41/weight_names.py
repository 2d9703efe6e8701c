"""DeepSeek-V4.1's checkpoint tensor names (the release's) and their mapping to its parameters
(`Target`, `EXPERT_PARTS`: engine/weight_names.py)."""

from __future__ import annotations

import re

from ..weight_names import EXPERT_PARTS, Target


_V41_EXPERT_RE = re.compile(r"^((?:layers|mtp)\.\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_V41_NAME_RE = re.compile(r"^(embed|head|norm)\.weight$|^(layers|mtp)\.\d+\.")


def v41_target_of(name: str) -> Target | None:
    """The V4.1 model names its parameters as the release names its tensors, except the routed
    experts: `…ffn.experts.E.w1/w3.weight` fill the gate / up rows of the stacked
    `…ffn.experts.w13.weight`, `w2` fills `…ffn.experts.w2.weight`. None for a name outside
    the release's scheme."""
    m = _V41_EXPERT_RE.match(name)
    if m:
        prefix, expert, part = m.groups()
        internal, rows = EXPERT_PARTS[part]
        return Target(f"{prefix}.{internal}", int(expert), rows)
    return Target(name) if _V41_NAME_RE.match(name) else None


def v41_export_names(internal: str, num_experts: int) -> list[tuple[str, int | None, str | None]]:
    """Release names (with expert index and row part) an internal V4.1 parameter is written as."""
    for suffix in (".ffn.experts.w13.weight", ".ffn.experts.w2.weight"):
        if internal.endswith(suffix):
            prefix = internal[: -len(suffix)] + ".ffn.experts"
            parts = [("w1", "gate"), ("w3", "up")] if "w13" in suffix else [("w2", "all")]
            return [(f"{prefix}.{e}.{w}.weight", e, part) for e in range(num_experts) for w, part in parts]
    return [(internal, None, None)]
