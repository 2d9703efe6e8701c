"""Decode step time: the per-sequence eager path vs the static-shape path (replayed from CUDA
graphs on a GPU, run eagerly elsewhere), side by side in one run, at several batch sizes.

Every variant runs the same greedy requests through the Engine and must produce the same
tokens; the figure is the median wall time of a pure decode step (after every prefill).

    python perf/bench_cuda_graphs.py [--preset small] [--device cpu|cuda] [--batch 1 8 32]
                                     [--prompt 256] [--steps 16] [--speculative-tokens 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.v4.checkpoint import preset_config, random_state, write_checkpoint  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from engine.weights import load_model  # noqa: E402
from perf.machine import header  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_steps(model, batch: int, prompt_len: int, steps: int, static: bool, k: int, device: str):
    """(median decode step seconds, every request's tokens)."""
    cfg = EngineConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=max(2048, prompt_len),
                       speculative_tokens=k, static_decode=static,
                       cuda_graph_sizes=tuple(sorted({1, 2, 4, 8, 16, 32, 64, batch})),
                       kv_cache_memory_bytes=1 << 30, max_model_len=prompt_len + steps * (k + 1) + 64)
    engine = Engine(model, cfg)
    gen = torch.Generator().manual_seed(1)
    for i in range(batch):
        prompt = torch.randint(2, model.cfg.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.add_request(i, prompt, SamplingParams(max_tokens=steps * (k + 1) + 4, ignore_eos=True))
    out: dict[int, list[int]] = {i: [] for i in range(batch)}
    times = []
    while engine.has_work:
        prefilling = any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or bool(engine.scheduler.waiting)
        _sync(device)
        t0 = time.perf_counter()
        deltas = engine.step().deltas
        _sync(device)
        if not prefilling and len(engine.scheduler.running) == batch and len(times) < steps:
            times.append(time.perf_counter() - t0)
        for d in deltas:
            out[d.request_id].extend(d.token_ids)
    replays = engine.static.num_replays if engine.static is not None else 0
    return statistics.median(times[2:] or times), out, replays


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--speculative-tokens", type=int, default=0)
    args = parser.parse_args()
    print(header("bench_cuda_graphs"), flush=True)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    cfg = preset_config(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, cfg, random_state(cfg, 0), dtype=torch.float32)
        model = load_model(tmp, dtype=dtype, device=args.device, progress=False)
    static_name = "graphs" if args.device.startswith("cuda") else "static"
    print(f"{args.preset} preset on {args.device} ({str(dtype).removeprefix('torch.')}), {args.prompt}-token prompts, "
          f"speculative tokens {args.speculative_tokens}; median decode step")
    print(f"{'batch':>5} {'eager ms':>9} {static_name + ' ms':>10} {'speed-up':>9} {'replays':>8}")
    for b in args.batch:
        eager, ref, _ = decode_steps(model, b, args.prompt, args.steps, False, args.speculative_tokens, args.device)
        fast, got, replays = decode_steps(model, b, args.prompt, args.steps, True, args.speculative_tokens,
                                          args.device)
        same = "" if got == ref else "  (outputs differ!)"
        print(f"{b:5d} {eager * 1e3:9.2f} {fast * 1e3:10.2f} {eager / fast:8.2f}x {replays:8d}{same}")


if __name__ == "__main__":
    main()
