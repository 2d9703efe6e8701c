"""`ringserve memory-report`: what one rank's GPU holds under data / expert parallelism.

Per rank: the bytes of its weights by kind, the KV pool that the GPU memory leaves after the
weights and a stated reserve, and how many sequences of a given context fit in it. Computed
by the code that allocates, never by a formula beside it:
  * the model is built on the meta device by its architecture (engine/models/ `meta_model`;
    V4: `engine.v4.weights.build_model`) with the stored
    dtypes (`--weight-dtype auto`: the checkpoint's own formats when MODEL is a checkpoint
    directory, else `quantization_config`; `bf16`: the upcast) and the rank's expert share
    (with expert parallelism (E + R) / N slots per MoE layer, placed by `engine.distributed.eplb`;
    without it every rank holds every expert);
  * DeepSeek-V4.1 (a release config.json, `text_config` inside): engine/v41/meta.py
    with the release's dtypes and storage (a checkpoint's headers, else `quantization_config`);
    expert parallelism splits the backbone's MoE layers only, every rank holding each DSpark
    stage whole (as the engine places them); the Engram tables count as their own kind;
  * the KV pools are allocated on the meta device by `KVCache.for_model` (V4.1:
    `V41KVCache.for_model`), the engine's own sizing, for the most sequences whose full context
    still fits.
All ranks hold the same number of bytes (dense weights are replicated, expert slots split
evenly), so one rank stands for all. Nothing is read but config.json and safetensors headers.

This module is imported by the CLI's parser: torch is imported only when the report runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 2**30
KINDS = ("attention", "compressor+indexer", "routed experts", "shared experts", "embed+head", "mHC+norms", "Engram",
         "MTP", "other")  # "Engram" (V4.1's hashed n-gram tables and their projections) only where it holds bytes
# What --reserve-gib stands for: the CUDA context and allocator slack, NCCL / all-to-all
# buffers, captured CUDA graphs, and the activations of one step (max-num-batched-tokens).
DEFAULT_RESERVE_GIB = 8.0
_NORM_LEAVES = frozenset({"attn_norm", "ffn_norm", "norm"})


def add_memory_report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory-report", help="per-rank GPU memory: weights by kind, KV pool left, sequences that fit")
    p.add_argument("model", help="model directory, config.json path (V4 or a V4.1 release config), or a known "
                                  "name (deepseek-v4-flash)")
    p.add_argument("--data-parallel-size", type=int, default=1, help="ranks (one GPU each)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="split each MoE layer's routed experts over the ranks (else every rank holds all)")
    p.add_argument("--num-redundant-experts", type=int, default=0,
                   help="extra expert replicas per MoE layer, spread over the ranks (EPLB); needs expert parallel")
    p.add_argument("--gpu-memory-gib", type=float, default=141.0, help="memory of one GPU in GiB (default 141: H200)")
    p.add_argument("--reserve-gib", type=float, default=DEFAULT_RESERVE_GIB,
                   help="kept free for the CUDA context, communication buffers, CUDA graphs and one step's "
                        "activations (default 8)")
    p.add_argument("--kv-dtype", choices=["bf16", "fp8", "fp4"], default="fp8",
                   help="KV record format (default fp8: e4m3 entries + fp4 index keys)")
    p.add_argument("--context", type=int, default=131072, help="tokens per sequence for the 'sequences that fit' line")
    p.add_argument("--weight-dtype", choices=["auto", "bf16"], default="auto",
                   help="auto: weights as stored (FP8 / FP4); bf16: decoded into bf16 at load")
    p.add_argument("--block-size", type=int, default=256, help="tokens per KV block")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (sizes the window pools)")
    p.add_argument("--no-mtp", dest="mtp", action="store_false", help="leave out the MTP layer (no speculation)")
    p.add_argument("--engram-tables", choices=["device", "host"], default="device",
                   help="V4.1: Engram tables on the GPU, or in host memory (as `serve --engram-tables host`)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=run)


def resolve_model(name: str) -> Path:
    """A path as given, or a known name from engine/configs (as `kv-report` resolves it)."""
    known = Path(__file__).resolve().parents[1] / "engine" / "configs" / f"{name}.json"
    return known if not Path(name).exists() and known.exists() else Path(name)


def kind_of(name: str) -> str:
    """Which row of the report a parameter (internal name; V4.1: the release name) counts in.
    V4.1's DSpark stages count as "MTP"."""
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]  # V4.1: `norm.weight`
    if parts[0] == "mtp":
        return "MTP"
    if parts[0] in ("embed", "head"):
        return "embed+head"
    if ".ffn.experts." in name:
        return "routed experts"
    if ".ffn.shared_w" in name or ".ffn.shared_experts." in name:
        return "shared experts"
    if ".engram." in name:
        return "Engram"
    if ".attn.compressor." in name or ".attn.indexer." in name:
        return "compressor+indexer"
    if ".attn." in name:
        return "attention"
    if leaf in _NORM_LEAVES or any(p.startswith("hc_") for p in parts):
        return "mHC+norms"
    return "other"  # the router: gate, gate bias, tid2eid


def rank_experts(num_layers: int, num_experts: int, ranks: int, redundant: int) -> dict[int, list[int]]:
    """Rank 0's logical experts per MoE layer under expert parallelism (EPLB placement of a
    uniform load: every rank gets (E + R) / N slots)."""
    import numpy as np

    from engine.distributed import eplb

    placement = eplb.rebalance(np.ones((num_layers, num_experts)), ranks, redundant)
    return {layer: placement.local_experts(layer, 0).tolist() for layer in range(num_layers)}


def _weights_by_kind(model) -> dict[str, dict[str, int]]:
    """kind → {'bytes', 'params'}: bytes as allocated (scales included), logical parameters."""
    from engine.linear import QuantWeight

    logical = {f"{path}.weight": m.num_params for path, m in model.named_modules() if isinstance(m, QuantWeight)}
    scales = {f"{path}.scale" for path, m in model.named_modules() if isinstance(m, QuantWeight)}
    out = {k: {"bytes": 0, "params": 0} for k in KINDS}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        row = out[kind_of(name)]
        row["bytes"] += t.numel() * t.element_size()
        if name not in scales:
            row["params"] += logical.get(name, t.numel())
    if not out["Engram"]["bytes"]:
        del out["Engram"]  # V4 has none
    return out


def _engram_tables(model) -> dict[str, int]:
    """{'bytes', 'params'} of the Engram tables (`engram.embed`, scales included): what
    `--engram-tables host` keeps in host memory."""
    from engine.linear import QuantWeight

    out = {"bytes": 0, "params": 0}
    for path, m in model.named_modules():
        if path.endswith(".engram.embed"):
            out["bytes"] += sum(t.numel() * t.element_size() for t in m.parameters())
            out["params"] += m.num_params if isinstance(m, QuantWeight) else m.weight.numel()
    return out


def build_rank_model(source: Path, ranks: int, expert_parallel: bool, redundant: int, weight_dtype: str,
                     mtp: bool = True):
    """(config, rank 0's model on the meta device in bf16 with its stored formats and share)."""
    from engine.config import ModelConfig
    from engine.models import registry

    cfg = ModelConfig.from_model_dir(source)
    arch = registry.of(cfg)
    with_mtp = mtp and cfg.num_nextn_predict_layers > 0
    experts = None
    if expert_parallel:  # the MoE layers the architecture splits (V4.1: the backbone's, not DSpark's)
        layers = len(arch.moe_layer_ids(cfg, cfg.num_nextn_predict_layers if with_mtp else 0))
        experts = rank_experts(layers, cfg.n_routed_experts, ranks, redundant)
    return cfg, arch.meta_model(cfg, source, weight_dtype, with_mtp, experts)


def fit_sequences(model, kv_dtype: str, context: int, budget: int, block_size: int, max_tokens: int):
    """(sequences, KVCache or None): the most sequences of `context` tokens whose blocks the pools
    that `KVCache.for_model` (V4.1: `V41KVCache.for_model`) allocates (on meta) within `budget`
    bytes can hold at once."""
    from engine.models import registry

    sizing = registry.of(model.cfg).cache_class()

    blocks_per_seq = -(-context // block_size)

    def cache_for(n: int):
        if budget <= 0:
            return None
        try:
            cache = sizing.for_model(model, kv_dtype, max(n, 1), max_tokens, memory_bytes=budget,
                                      block_size=block_size)
        except ValueError:  # not even the window blocks fit
            return None
        return cache if cache.manager.full.num_blocks - 1 >= n * blocks_per_seq else None

    lo, hi = 0, 1
    while cache_for(hi) is not None:  # grow until a count fails, then bisect
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cache_for(mid) is not None else (lo, mid)
    return lo, cache_for(lo) if lo else None


def memory_report(model: str, data_parallel_size: int = 1, enable_expert_parallel: bool = False,
                  num_redundant_experts: int = 0, gpu_memory_gib: float = 141.0,
                  reserve_gib: float = DEFAULT_RESERVE_GIB, kv_dtype: str = "fp8", context: int = 131072,
                  weight_dtype: str = "auto", block_size: int = 256, max_num_batched_tokens: int = 2048,
                  mtp: bool = True, engram_tables: str = "device") -> dict:
    """The report as a dict (what --json prints)."""
    if data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be ≥ 1")
    if num_redundant_experts and not enable_expert_parallel:
        raise ValueError("--num-redundant-experts needs --enable-expert-parallel")
    if context < 1 or gpu_memory_gib <= 0 or reserve_gib < 0:
        raise ValueError("--context, --gpu-memory-gib must be positive and --reserve-gib ≥ 0")
    source = resolve_model(model)
    cfg, meta = build_rank_model(source, data_parallel_size, enable_expert_parallel, num_redundant_experts,
                                 weight_dtype, mtp)
    kinds = _weights_by_kind(meta)
    host = _engram_tables(meta) if engram_tables == "host" else {"bytes": 0, "params": 0}
    if host["bytes"]:  # the Engram row keeps only what stays on the GPU (wkv, gate weights)
        kinds["Engram"] = {k: kinds["Engram"][k] - host[k] for k in ("bytes", "params")}
    weights = sum(k["bytes"] for k in kinds.values())
    gpu, reserve = int(gpu_memory_gib * GIB), int(reserve_gib * GIB)
    budget = gpu - weights - reserve
    seqs, cache = fit_sequences(meta, kv_dtype, context, budget, block_size, max_num_batched_tokens)
    local = meta.layers[0].ffn.experts.num_local_experts
    return {
        "model": str(source), "data_parallel_size": data_parallel_size,
        "expert_parallel": enable_expert_parallel, "num_redundant_experts": num_redundant_experts,
        "weight_dtype": weight_dtype, "kv_dtype": kv_dtype, "mtp": bool(len(meta.mtp)),
        "routed_experts_per_layer": local, "n_routed_experts": cfg.n_routed_experts,
        "gpu_bytes": gpu, "reserve_bytes": reserve, "weights": kinds, "weight_bytes": weights,
        "parameters_on_rank": sum(k["params"] for k in kinds.values()) + host["params"],
        "engram_tables": engram_tables, "host_bytes": host["bytes"], "host_params": host["params"],
        "kv_budget_bytes": budget, "fits": budget > 0, "context": context, "block_size": block_size,
        "sequences": seqs, "kv_pool_bytes": cache.nbytes if cache is not None else 0,
        "kv_full_blocks": cache.manager.full.num_blocks if cache is not None else 0,
    }


def run(args: argparse.Namespace) -> int:
    report = memory_report(args.model, args.data_parallel_size, args.enable_expert_parallel,
                           args.num_redundant_experts, args.gpu_memory_gib, args.reserve_gib, args.kv_dtype,
                           args.context, args.weight_dtype, args.block_size, args.max_num_batched_tokens, args.mtp,
                           args.engram_tables)
    if args.json:
        print(json.dumps(report))
        return 0
    print(render(report))
    return 0


def render(r: dict) -> str:
    """The report as a table (sizes in GiB)."""
    ep = (f"expert parallel, {r['num_redundant_experts']} redundant experts" if r["expert_parallel"]
          else "no expert parallelism")
    lines = [f"{r['model']}: {r['data_parallel_size']} ranks, {ep}, weights {r['weight_dtype']}, "
             f"kv {r['kv_dtype']}{'' if r['mtp'] else ', no MTP'}",
             f"per rank: {r['routed_experts_per_layer']} of {r['n_routed_experts']} routed experts per MoE layer, "
             f"{r['parameters_on_rank'] / 1e9:.2f}B parameters",
             f"{'kind':22} {'params':>10} {'GiB':>9}"]
    for kind, row in r["weights"].items():
        lines.append(f"{kind:22} {row['params'] / 1e9:9.3f}B {row['bytes'] / GIB:9.2f}")
    lines += [f"{'weights':22} {'':>10} {r['weight_bytes'] / GIB:9.2f}",
              f"{'reserve':22} {'':>10} {r['reserve_bytes'] / GIB:9.2f}   (CUDA context, comm buffers, graphs, "
              f"activations)",
              f"{'GPU':22} {'':>10} {r['gpu_bytes'] / GIB:9.2f}"]
    if r.get("host_bytes"):
        lines.append(f"{'Engram tables (host)':22} {r['host_params'] / 1e9:9.3f}B {r['host_bytes'] / GIB:9.2f}   "
                     f"(host memory, not in the GPU's weights)")
    if not r["fits"]:
        lines.append(f"does not fit: weights + reserve exceed the GPU by {-r['kv_budget_bytes'] / GIB:.2f} GiB")
        return "\n".join(lines)
    lines += [f"{'KV pool budget':22} {'':>10} {r['kv_budget_bytes'] / GIB:9.2f}",
              f"sequences of {r['context']:,} tokens that fit: {r['sequences']:,} "
              f"(KV pools {r['kv_pool_bytes'] / GIB:.2f} GiB, {r['kv_full_blocks']:,} blocks of {r['block_size']})"]
    return "\n".join(lines)
