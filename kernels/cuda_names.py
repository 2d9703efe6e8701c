"""Template instantiations (NVRTC name expressions) of each .cu file, shared by the launch
wrappers and the compile check so that every instantiation the engine can launch is compiled.
"""
from __future__ import annotations

IN_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}
ROUTE_PER_LANE = (1, 2, 4, 8, 12, 16)   # experts per lane; E <= 32 * 16 = 512


def kv_cache_names() -> tuple[str, ...]:
    names = []
    for t in IN_TYPES.values():
        names += [f"scatter_bf16<{t}>", f"scatter_fp8_ds_mla<{t}, 64>",
                  f"scatter_fp4<{t}, 16, false>", f"scatter_fp4<{t}, 32, true>",
                  f"gather_bf16<{t}>", f"gather_fp8_ds_mla<{t}, 64>",
                  f"gather_fp4<{t}, 16, false>", f"gather_fp4<{t}, 32, true>"]
    return tuple(names)


def moe_routing_names() -> tuple[str, ...]:
    return tuple(f"route_topk<{p}>" for p in ROUTE_PER_LANE) + (
        "route_hash", "permute_count", "permute_offsets", "permute_scatter")


NAME_EXPRESSIONS = {"kv_cache": kv_cache_names(), "moe_routing": moe_routing_names()}
