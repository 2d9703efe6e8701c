"""CPU decode step of one checkpoint: the decode paths and kernels side by side, in one run.

Variants, each an Engine on the same loaded weights (batch B: B prompts of --prompt-len prefilled
in one step, then --steps decode steps; ms per decode step, and ms for that prefill step):
  default  the engine on CPU with exact fp32 matmuls: decode steps on the static-shape fused forward
           (engine/fused_decode.py) with the numba kernels of kernels/cpu_decode.py, weights kept
           FP8/FP4 with decode-sized GEMMs on the fused row kernels
  ref-ops  as default, with kernels/cpu_decode.py's ops swapped for their torch references
           (kernels/decode_reference.py): what the numba kernels save
  per-seq  decode steps on the per-sequence path (`static_decode=False`, engine/attention.py's
           SequenceContext: torch ops per sequence and layer)
  tiled    as default, every GEMM on the tiled path (tile decode + sgemm)
  ops-moe  as default, each decode-sized MoE layer op by op (route, permute, gather, products,
           SwiGLUs, combine) instead of kernels/cpu_moe_decode.py's two jitted calls
  generic  as default, the quantized products through the generic kernel entry points instead
           of the weights prepared once (kernels/cpu_prepared_gemm.py): what the per-call
           checks and views cost
  bf16     as default with `--weight-dtype bf16`: every weight decoded once at load (2-4x the memory)
  bf16-mm  as default with `--cpu-matmul-precision bf16` (kernels/cpu_precision.py): torch's fp32
           matmuls multiply bf16 operands with fp32 accumulation (oneDNN); what `ringserve serve`
           runs on a CPU with AMX
Rounds interleave the variants (default, ref-ops, …) so a busy neighbour slows them alike;
medians over --rounds. Ratios are variant / default (> 1: the default is faster). --dtype is
the compute dtype (fp32: what `ringserve serve` runs on CPU).

    python perf/bench_cpu_decode.py --model-dir .peer-cache/models/v4-tiny6 [--batch 1 16] [--threads 1]
        [--variants ref-ops per-seq tiled bf16] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.fused_decode import FusedDecoder
from engine.linear import QuantWeight
from engine.weights import load_model
from ipc.messages import SamplingParams
from kernels import cpu_decode, cpu_quant_gemm
from kernels.cpu_precision import matmul_precision
from perf.bench_quant_gemm import tiled
from perf.machine import header, set_cpu_threads

VARIANTS = ["default", "ref-ops", "per-seq", "tiled", "ops-moe", "generic", "bf16", "bf16-mm"]


def step_ms(model, batch: int, prompt_len: int, steps: int, static: bool = True) -> tuple[float, float]:
    """(ms per decode step, ms of the prefill step before them): one measurement."""
    engine = Engine(model, EngineConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
                                        num_kv_blocks=batch * (-(-(prompt_len + steps) // 256) + 2) + 4,
                                        block_size=256, speculative_tokens=0,
                                        max_model_len=prompt_len + steps + 8, static_decode=static))
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(3, model.cfg.vocab_size - 1, (prompt_len,), generator=g).tolist()
        engine.add_request(i, prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()                                            # the prefill (every prompt fits one step)
    prefill_ms = 1000 * (time.perf_counter() - t0)
    t0, n = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        n += 1
    return 1000 * (time.perf_counter() - t0) / max(n, 1), prefill_ms


@contextlib.contextmanager
def moe_op_by_op():
    """The fused decode's MoE layers op by op (FusedDecoder.cpu_moe off)."""
    saved = FusedDecoder.cpu_moe
    FusedDecoder.cpu_moe = False
    try:
        yield
    finally:
        FusedDecoder.cpu_moe = saved


@contextlib.contextmanager
def generic_products():
    """No prepared CPU weights: every quantized product through the generic entry points."""
    saved = QuantWeight.cpu_prepared
    QuantWeight.cpu_prepared = lambda self, weight, scale: None
    try:
        yield
    finally:
        QuantWeight.cpu_prepared = saved


@contextlib.contextmanager
def reference_ops():
    """kernels/cpu_decode.py's ops replaced by the torch references they were checked against."""
    from kernels import decode_reference as ref
    refs = {name: getattr(ref, f"{name}_reference") for name in cpu_decode.__all__}
    saved = {name: getattr(cpu_decode, name) for name in refs}
    try:
        for name, fn in refs.items():
            setattr(cpu_decode, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(cpu_decode, name, fn)


def run_variant(name: str, models: dict, batch: int, args) -> tuple[float, float]:
    def run() -> tuple[float, float]:
        return step_ms(models["bf16" if name == "bf16" else "auto"], batch, args.prompt_len, args.steps,
                       static=name != "per-seq")
    if name == "ref-ops":
        with reference_ops():
            return run()
    if name == "ops-moe":
        with moe_op_by_op():
            return run()
    if name == "generic":
        with generic_products():
            return run()
    if name == "bf16-mm":
        with matmul_precision("bf16"):
            return run()
    return tiled(run)() if name == "tiled" else run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--variants", nargs="+", default=VARIANTS[1:], choices=VARIANTS,
                        help="default is always run (the baseline)")
    args = parser.parse_args()
    print(header("bench_cpu_decode"), flush=True)
    set_cpu_threads(args.threads)
    variants = ["default"] + [v for v in dict.fromkeys(args.variants) if v != "default"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    models = {wd: load_model(args.model_dir, dtype=dtype, progress=False, weight_dtype=wd)
              for wd in ("auto", "bf16") if wd == "auto" or "bf16" in variants}
    print(f"# {args.model_dir}; {args.dtype}; {args.threads} thread(s); prompt {args.prompt_len}, {args.steps} "
          f"steps, median of {args.rounds} interleaved rounds; GEMV_MAX_ROWS={cpu_quant_gemm.GEMV_MAX_ROWS} "
          f"(FP4 {cpu_quant_gemm.FP4_GEMV_MAX_ROWS})")
    others = variants[1:]
    print(f"{'batch':>5s} {'phase':>7s} " + " ".join(f"{v + ' ms':>10s}" for v in variants) + " "
          + " ".join(f"{v + '/default':>16s}" for v in others))
    for batch in args.batch:
        for name in variants:                                # warm-up: numba cache, allocator
            run_variant(name, models, batch, argparse.Namespace(prompt_len=args.prompt_len, steps=2))
        times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name in variants:
                times[name].append(run_variant(name, models, batch, args))
        for i, phase in enumerate(("decode", "prefill")):
            med = {v: statistics.median(t[i] for t in ts) for v, ts in times.items()}
            print(f"{batch:5d} {phase:>7s} " + " ".join(f"{med[v]:10.1f}" for v in variants) + " "
                  + " ".join(f"{med[v] / med['default']:15.2f}x" for v in others), flush=True)


if __name__ == "__main__":
    main()
