"""The engine's command-line flags, shared by `ringserve generate` and `ringserve serve` (vLLM-style
names), and the configs they make: EngineConfig, ParallelConfig and the image input. No torch
here; server/cli.py and server/serve.py both import it (neither imports the other's flags).
"""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by `generate` and `serve` (vLLM-style names)."""
    p.add_argument("--mode", choices=["throughput", "single-user"], default="throughput",
                   help="throughput: many users, large batches; single-user: batch ≤ 4, speculation on")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="compute dtype (auto: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--kv-dtype", choices=["auto", "bf16", "fp8", "fp4"], default="auto",
                   help="KV record format (auto: the compute dtype)")
    p.add_argument("--weight-dtype", choices=["auto", "bf16"], default="auto",
                   help="weight storage: auto keeps the checkpoint's form (FP8 dense projections and FP4 "
                        "routed experts stay quantized, dequantized inside the GEMM kernels); bf16 decodes "
                        "every weight into the compute dtype at load (more memory)")
    p.add_argument("--cpu-matmul-precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="fp32 matmuls on CPU: exact (fp32), or bf16 operands with fp32 accumulation, TF32's "
                        "role on GPUs (bf16: 3-3.5x on prefill GEMMs with AMX); auto: bf16 on CPUs with AMX or AVX512-BF16 unless "
                        "--dtype fp32 was given or the model is DeepSeek-V4.1")
    p.add_argument("--engram-tables", choices=["device", "host"], default="device",
                   help="DeepSeek-V4.1's Engram n-gram tables: on the device, or in host memory (looked up "
                        "there; a step copies only the rows it reads: what lets the released V4.1-Flash fit "
                        "8×H200, see `ringserve memory-report --engram-tables host`)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a token's result never depends on what else shares its step (DeepSeek-V4.1 only): "
                        "greedy output with speculation then equals greedy output without, bit for bit; slower")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step (mode default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (mode default)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: min(model, 32768))")
    p.add_argument("--speculative-tokens", type=int, default=None,
                   help="MTP draft tokens per step, 0 disables (mode default: 3 single-user, 0 throughput)")
    p.add_argument("--no-adaptive-speculation", dest="adaptive_speculation", action="store_false",
                   help="always verify all --speculative-tokens drafts (default: as many as measured acceptance "
                        "and step cost make worthwhile)")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="batch sizes captured as decode/verify CUDA graphs (mode default: 1 2 4 single-user, "
                        "1 2 4 … 64 throughput)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule and launch decode step t+1 before reading step t back, so host work overlaps "
                        "the device (vLLM's flag; ignored with speculation, PD roles and expert parallelism)")
    p.add_argument("--cpu-decode-steps", type=int, default=4, metavar="N",
                   help="CPU: greedy decode steps one compiled call may run (each token the argmax of the step "
                        "before; stops at a request's stop ids), so the engine's per-step Python is paid once "
                        "per N tokens; streams then get up to N tokens at a time, and a call runs as many as fit "
                        "~20 ms. 1 = a call per step (default 4; plain greedy requests without speculation or "
                        "async scheduling)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs: decode steps run the per-sequence eager path")
    p.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB for the KV pools")
    p.add_argument("--block-size", type=int, default=256, help="tokens per KV block")
    p.add_argument("--decoder-tail", choices=["exact", "approx"], default="exact",
                   help="DeepSeek-V4.1 prefill: approx runs the layers after the last KV source on each prefill "
                        "chunk's last sliding-window tokens only (decoder-tail bounded replay); exact runs all")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the global KV blocks of prompts' cached prefixes (default on, as in vLLM)")
    p.add_argument("--prefix-replay", choices=["exact", "bounded"], default="exact",
                   help="sliding state at a prefix hit: exact (snapshots at block boundaries, else a replay of "
                        "the window stack's receptive field; output as a cold run) or bounded (vLLM's "
                        "approximation: recompute only the last window before the hit)")
    g = p.add_argument_group("image input (DeepSeek-V4.1)")
    g.add_argument("--language-model-only", action="store_true",
                   help="load no vision tower (vLLM's flag): the model serves text, and image input is refused")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='images per prompt, in vLLM\'s form: \'{"image": 4}\' (default 8; 0 refuses images)')
    add_parallel_args(p)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Parallelism across worker processes, as vLLM spells it."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--data-parallel-size", "--dp", dest="dp", type=int, default=1,
                   help="data-parallel ranks, one worker process each (one GPU each on a GPU machine)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard the routed experts over the data-parallel ranks (DEP: data-parallel attention, "
                        "expert-parallel MoE); the ranks step in lockstep")
    g.add_argument("--num-redundant-experts", type=int, default=0,
                   help="extra expert replicas over the group (EPLB gives them to the most loaded experts)")
    g.add_argument("--enable-eplb", action="store_true", help="rebalance expert placement from measured load")
    g.add_argument("--eplb-step-interval", type=int, default=3000, help="engine steps between EPLB rebalances")
    g.add_argument("--all2all-backend", default="auto",
                   choices=["auto", "all_to_all", "padded_all_to_all", "allgather_reducescatter"],
                   help="MoE dispatch/combine: uneven all-to-all, fixed-size padded buffers (CUDA-graph safe), "
                        "or all-gather + reduce-scatter; auto: padded on CUDA, uneven on CPU")
    g.add_argument("--data-parallel-size-local", type=int, default=None,
                   help="ranks this node runs (multi-node; default: all)")
    g.add_argument("--data-parallel-start-rank", type=int, default=0, help="the first rank this node runs")
    g.add_argument("--data-parallel-address", default="127.0.0.1", help="the head node's address")
    g.add_argument("--data-parallel-rpc-port", type=int, default=29550,
                   help="the head's port for headless nodes (the rendezvous store listens on the next port)")
    g.add_argument("--headless", action="store_true", help="run this node's ranks and no HTTP server")
    g.add_argument("--rendezvous-timeout", type=float, default=300.0,
                   help="seconds every node and rank has to join the group at start")


def parallel_config_from(args: argparse.Namespace):
    from engine.config import ParallelConfig

    return ParallelConfig(data_parallel_size=args.dp, data_parallel_size_local=args.data_parallel_size_local,
                          data_parallel_start_rank=args.data_parallel_start_rank,
                          data_parallel_address=args.data_parallel_address,
                          data_parallel_rpc_port=args.data_parallel_rpc_port, headless=args.headless,
                          rendezvous_timeout_s=args.rendezvous_timeout,
                          enable_expert_parallel=args.enable_expert_parallel,
                          num_redundant_experts=args.num_redundant_experts, enable_eplb=args.enable_eplb,
                          eplb_step_interval=args.eplb_step_interval, all2all_backend=args.all2all_backend)


def engine_config_from(args: argparse.Namespace):
    from engine.config import EngineConfig

    return EngineConfig(mode=args.mode, dtype=args.dtype, kv_dtype=args.kv_dtype, weight_dtype=args.weight_dtype,
                        cpu_matmul_precision=args.cpu_matmul_precision, engram_tables=args.engram_tables,
                        batch_invariant=args.batch_invariant,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        speculative_tokens=args.speculative_tokens,
                        cuda_graph_sizes=tuple(args.cuda_graph_sizes or ()),
                        enforce_eager=args.enforce_eager, adaptive_speculation=args.adaptive_speculation,
                        async_scheduling=getattr(args, "async_scheduling", False),
                        cpu_decode_steps=getattr(args, "cpu_decode_steps", 4),
                        kv_cache_memory_bytes=int(args.kv_cache_memory * 2**30), block_size=args.block_size,
                        decoder_tail=args.decoder_tail,
                        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
                        prefix_replay=getattr(args, "prefix_replay", "exact"), **_vision_fields(args))


def _vision_fields(args: argparse.Namespace) -> dict:
    """EngineConfig's vision switches the engine knows (`language_model_only`)."""
    import dataclasses

    from engine.config import EngineConfig

    known = {f.name for f in dataclasses.fields(EngineConfig)}
    lmo = getattr(args, "language_model_only", False)
    return {"language_model_only": lmo} if "language_model_only" in known else {}


def multimodal_from(args: argparse.Namespace, model_cfg, policy=None):
    """The image input of a model under the flags (server/multimodal.py); ValueError naming the flag."""
    from server.multimodal import Multimodal, parse_mm_limit

    return Multimodal.for_model(model_cfg, language_model_only=getattr(args, "language_model_only", False),
                                limit=parse_mm_limit(getattr(args, "limit_mm_per_prompt", None)), policy=policy)
