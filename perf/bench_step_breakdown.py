"""Where a decode step's time goes, and how the step grows with context: one table per device.

Runs the engine's static decode step (StaticDecodeBackend with the fused forward of
engine/fused_decode.py: Triton kernels on CUDA, the CPU kernels behind the same dispatch on CPU)
for B sequences at each context length, and splits its wall time by component with exclusive
timers around the decoder's parts (a part's time excludes the parts it calls):
  mHC         kernels.mhc_mix / mhc_expand (Sinkhorn mixing, norm, stream expansion)
  attention   FusedDecoder.attention less the indexer and compressor (projections, norm+RoPE,
              KV store, sparse MLA over the window and the selected entries)
  indexer     kernels.indexer_topk (scores over each sequence's index keys, top-k)
  compressor  FusedDecoder._compress (the compressor steps of the attention and the indexer)
  MoE         FusedDecoder.moe (routing, grouped GEMMs, shared expert, combine)
  sampling    the step's on-device sampling of B rows and its one read back
  comm        0 on one device (expert parallelism is not run here)
  host/other  the rest of the step: step tables, embedding, the head and logits, Python
On CUDA each timed region is bracketed by a synchronize (so the split is real, at the cost of
the overlap the uncaptured step would have); the step total is taken separately without them.

The KV pools are allocated for the full context but not prefilled (prefilling 256k tokens on CPU
takes hours): the step reads and computes over every position exactly as it would after a
prefill, only the values are zeros, so times are right and logits meaningless.

    python perf/bench_step_breakdown.py [--preset small] [--batch 1] [--contexts 4096 65536 262144]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from engine import fused_decode  # noqa: E402
from engine.attention_backend import StepSeq  # noqa: E402
from engine.cuda_graphs import StaticDecodeBackend  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.sampler import SamplingRows, probs_device, sample_device  # noqa: E402
from engine import counter_rng  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from engine.checkpoint import preset_config, random_state, write_checkpoint  # noqa: E402
from engine.weights import load_model  # noqa: E402

COMPONENTS = ("MoE", "attention", "indexer", "compressor", "mHC", "sampling", "comm", "host/other")


class Timers:
    """Exclusive wall time per component; nested regions are subtracted from their parent."""

    def __init__(self, sync):
        self.sync, self.total = sync, defaultdict(float)
        self._stack: list[list] = []  # [name, start, time spent in children]

    @contextmanager
    def region(self, name: str):
        self.sync()
        self._stack.append([name, time.perf_counter(), 0.0])
        try:
            yield
        finally:
            self.sync()
            _, start, children = self._stack.pop()
            spent = time.perf_counter() - start
            self.total[name] += spent - children
            if self._stack:
                self._stack[-1][2] += spent


@contextmanager
def timed_parts(timers: Timers):
    """Wrap the decoder's parts (module/class attributes looked up at call time) in timers."""
    targets = [(kernels, "mhc_mix", "mHC"), (kernels, "mhc_expand", "mHC"), (kernels, "indexer_topk", "indexer"),
               (fused_decode.FusedDecoder, "attention", "attention"), (fused_decode.FusedDecoder, "moe", "MoE"),
               (fused_decode.FusedDecoder, "_compress", "compressor")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in targets]

    def wrap(fn, part):
        def timed(*args, **kwargs):
            with timers.region(part):
                return fn(*args, **kwargs)
        return timed

    for (owner, name, part), (_, _, fn) in zip(targets, saved):
        raw = fn.__func__ if isinstance(fn, staticmethod) else fn
        wrapped = wrap(raw, part)
        setattr(owner, name, staticmethod(wrapped) if isinstance(fn, staticmethod) else wrapped)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def build(preset: str, device: str):
    """A random-weight model of the preset (bf16 on CUDA, fp32 on CPU)."""
    cfg = preset_config(preset)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), cfg, random_state(cfg, 0), layout="upstream", dtype=torch.float32)
        return load_model(tmp, dtype=dtype, device=device, progress=False)


def unfilled(model, kv_dtype: str, batch: int, context: int, block_size: int = 64):
    """A cache with `batch` sequences allocated up to `context` (+1 for the step), not prefilled."""
    blocks = batch * (-(-(context + 2) // block_size) + 1) + 4
    cache = KVCache.for_model(model, kv_dtype, max_num_seqs=batch, num_full_blocks=blocks, block_size=block_size)
    rows = []
    for i in range(batch):
        seq = cache.new_sequence()
        assert cache.allocate(seq, 0, context + 1), "KV pool too small"
        rows.append(StepSeq(seq, context, [7 + i]))
    return cache, rows


def sampling_step(logits: torch.Tensor) -> None:
    """The step's sampling at B rows (temperature 0.8, top-p 0.9, seeded) and its one read back."""
    b = logits.shape[0]
    rows = SamplingRows([SamplingParams(temperature=0.8, top_p=0.9, seed=1)] * b, [1] * b, list(range(b)),
                        logits.device)
    keys = counter_rng.row_keys(rows.seeds, rows.counters, counter_rng.SAMPLE)
    sample_device(probs_device(logits.float(), rows), keys).cpu()


@torch.inference_mode()
def measure(model, kv_dtype: str, batch: int, context: int, steps: int) -> tuple[float, dict[str, float]]:
    """(mean step seconds untimed inside, mean seconds per component with timers inside)."""
    cuda = model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cache, rows = unfilled(model, kv_dtype, batch, context)
    backend = StaticDecodeBackend(model, cache, (batch,), (1,), context + 64, capture=cuda, fused=True)
    step = backend.prepare(rows)
    _, logits = step.run(model, None)  # warm-up (and the capture on CUDA)
    sampling_step(logits)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        _, logits = step.run(model, None)
        sampling_step(logits)
    sync()
    plain = (time.perf_counter() - t0) / steps
    timers = Timers(sync)
    step = StaticDecodeBackend(model, cache, (batch,), (1,), context + 64, capture=False, fused=True).prepare(rows)
    with timed_parts(timers):
        for _ in range(steps):
            with timers.region("host/other"):
                _, logits = step.run(model, None)
                with timers.region("sampling"):
                    sampling_step(logits)
    parts = {name: timers.total[name] / steps for name in COMPONENTS}
    return plain, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="checkpoint preset (engine/checkpoint.py)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536, 262144])
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8", "fp4"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = build(args.preset, args.device)
    cfg = model.cfg
    print(f"{args.device} | torch {torch.__version__} | preset {args.preset}: {cfg.num_layers} layers "
          f"{list(cfg.layer_kinds)}, index top-k {cfg.index_topk}, kv {args.kv_dtype}, batch {args.batch}")
    print(f"\n{'context':>8s} {'step ms':>9s} {'vs first':>8s}  " + " ".join(f"{c:>10s}" for c in COMPONENTS)
          + "   (share of the timed step)")
    first = None
    for context in args.contexts:
        plain, parts = measure(model, args.kv_dtype, args.batch, context, args.steps)
        first = first or plain
        timed = sum(parts.values())
        print(f"{context:8d} {plain * 1e3:9.2f} {plain / first:7.2f}x  "
              + " ".join(f"{100 * parts[c] / timed:9.1f}%" for c in COMPONENTS), flush=True)


if __name__ == "__main__":
    main()
