"""Which weights a DeepSeek-V4 release stores quantized, and a model's format plan from its config.

Model-spec §3: the dense projections wq_a, wq_b, wkv, wo_a, wo_b, the shared expert, the
indexer's wq_b and MTP's e/h_proj are FP8 e4m3 with ue8m0 block scales (128×128); the routed
experts are FP4 e2m1 with a ue8m0 scale per 32 along K. The compressors' and indexer's
wkv/wgate, weights_proj, embed and head are BF16. A plan maps the module path of every
quantized `QuantWeight` to its `WeightFormat`; weights absent from it are dense.

`formats_from_config` reads the plan off `quantization_config` (what `memory-report` needs
without a checkpoint); the loader derives it from the tensors themselves
(engine/weights.py), and for a checkpoint written by `make-model --quantize fp8-fp4` the two
agree.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.reference import FP4_GROUP

from ..config import ModelConfig
from ..linear import DENSE, GroupedLinear, Linear, RoutedExperts, WeightFormat

# Leaf names of the projections the release stores as FP8 (outside any compressor).
RELEASE_FP8 = frozenset({"wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_w1", "shared_w2", "shared_w3",
                         "e_proj", "h_proj"})


def released_fp8(module_path: str) -> bool:
    """True for the module paths of projections the release stores as FP8."""
    parts = module_path.split(".")
    return parts[-1] in RELEASE_FP8 and "compressor" not in parts


def formats_from_config(model: nn.Module, cfg: ModelConfig) -> dict[str, WeightFormat]:
    """The plan `cfg.quantization` (quantization_config) describes; {} for an unquantized model."""
    q = cfg.quantization or {}
    if q.get("quant_method") != "fp8":
        return {}
    scale_dtype = torch.float8_e8m0fnu if q.get("scale_fmt") == "ue8m0" else torch.float32
    dense = WeightFormat.fp8(tuple(q.get("weight_block_size", (128, 128))), scale_dtype)
    experts = WeightFormat.fp4(FP4_GROUP, scale_dtype) if q.get("expert_dtype") == "fp4" else dense
    plan: dict[str, WeightFormat] = {}
    for path, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            plan[f"{path}.w13"] = plan[f"{path}.w2"] = experts
        elif isinstance(module, Linear) and released_fp8(path):
            # wo_a stays dense (dequantized at load) when a scale row would straddle two groups.
            plan[path] = dense if not isinstance(module, GroupedLinear) or module.supports(dense) else DENSE
    return {path: fmt for path, fmt in plan.items() if fmt.quantized}
