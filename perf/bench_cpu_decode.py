"""CPU decode step of one checkpoint: the quantized-GEMM paths side by side, in one run.

Variants, each an Engine on the same loaded weights (batch B: B prompts of --prompt-len, then
--steps decode steps; ms per decode step):
  fused   weights kept FP8/FP4, decode-sized GEMMs on the fused row kernels (the default)
  tiled   weights kept FP8/FP4, every GEMM on the tiled path (tile decode + sgemm; the old path)
  bf16    `--weight-dtype bf16`: every weight decoded once at load (2-4x the weight memory)
  loop    as fused, with mHC's Sinkhorn as the torch loop (~120 ops per site) instead of the one
          numba call of kernels/sinkhorn.py
  static  as fused, decode steps on the static-shape fused forward (`--static-decode`:
          engine/fused_decode.py with kernels/cpu_decode.py) instead of the per-sequence path
Rounds interleave the variants (fused, tiled, bf16, fused, …) so a busy neighbour slows them
alike; medians over --rounds. Ratios are variant / fused (> 1: fused is faster).

    python perf/bench_cpu_decode.py --model-dir .peer-cache/models/v4-tiny6 [--batch 1 16] [--threads 1]
        [--variants fused tiled bf16 loop]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.weights import load_model
from ipc.messages import SamplingParams
from kernels import cpu_quant_gemm, sinkhorn
from perf.bench_quant_gemm import tiled
from perf.machine import header, set_cpu_threads


def step_ms(model, batch: int, prompt_len: int, steps: int, static: bool = False) -> float:
    """ms per decode step after the prompts' prefill (one measurement)."""
    engine = Engine(model, EngineConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
                                        num_kv_blocks=batch * (-(-(prompt_len + steps) // 256) + 2) + 4,
                                        block_size=256, speculative_tokens=0,
                                        max_model_len=prompt_len + steps + 8, static_decode=static,
                                        cuda_graph_sizes=(batch,) if static else ()))
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(3, model.cfg.vocab_size - 1, (prompt_len,), generator=g).tolist()
        engine.add_request(i, prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    engine.step()                                            # the prefill (every prompt fits one step)
    t0, n = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        n += 1
    return 1000 * (time.perf_counter() - t0) / max(n, 1)


def run_variant(name: str, models: dict, batch: int, args) -> float:
    def run() -> float:
        return step_ms(models["bf16" if name == "bf16" else "auto"], batch, args.prompt_len, args.steps,
                       static=name == "static")
    if name == "loop":
        with sinkhorn.torch_loop():
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
    parser.add_argument("--variants", nargs="+", default=["fused", "tiled", "bf16", "loop", "static"],
                        choices=["fused", "tiled", "bf16", "loop", "static"], help="fused is always run (the baseline)")
    args = parser.parse_args()
    print(header("bench_cpu_decode"), flush=True)
    set_cpu_threads(args.threads)
    variants = ["fused"] + [v for v in dict.fromkeys(args.variants) if v != "fused"]
    models = {wd: load_model(args.model_dir, progress=False, weight_dtype=wd)
              for wd in ("auto", "bf16") if wd == "auto" or "bf16" in variants}
    print(f"# {args.model_dir}; {args.threads} thread(s); prompt {args.prompt_len}, {args.steps} steps, "
          f"median of {args.rounds} interleaved rounds; GEMV_MAX_ROWS={cpu_quant_gemm.GEMV_MAX_ROWS}")
    others = variants[1:]
    print(f"{'batch':>5s} " + " ".join(f"{v + ' ms':>9s}" for v in variants) + " "
          + " ".join(f"{v + '/fused':>11s}" for v in others))
    for batch in args.batch:
        for name in variants:                                # warm-up: numba cache, allocator
            run_variant(name, models, batch, argparse.Namespace(prompt_len=args.prompt_len, steps=2))
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name in variants:
                times[name].append(run_variant(name, models, batch, args))
        med = {v: statistics.median(t) for v, t in times.items()}
        print(f"{batch:5d} " + " ".join(f"{med[v]:9.1f}" for v in variants) + " "
              + " ".join(f"{med[v] / med['fused']:10.2f}x" for v in others), flush=True)


if __name__ == "__main__":
    main()
