"""Where a decode step's time goes, and how the step grows with context: one table per device.

Runs the engine's static decode step (StaticDecodeBackend with the fused forward of
engine/v4/fused_decode.py: Triton kernels on CUDA, the CPU kernels behind the same dispatch on CPU)
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

On CUDA it also counts the kernels one uncaptured step launches (torch.profiler), and prints the
bandwidth the attention side (KV records the step needs / its time) and the MoE (routed expert
weight bytes read / its time) reach against the device's copy bandwidth.

    python perf/bench_step_breakdown.py [--preset small] [--batches 1] [--contexts 4096 65536 262144]
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
from engine import linear  # noqa: E402
from engine import counter_rng  # noqa: E402
from engine.attention_backend import StepSeq  # noqa: E402
from engine.cuda_graphs import StaticDecodeBackend  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.sampler import SamplingRows, probs_device, sample_device  # noqa: E402
from engine.v4 import fused_decode  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from engine.v4.checkpoint import preset_config, random_state, write_checkpoint  # noqa: E402
from engine.weights import load_model  # noqa: E402
from perf.bench_gpu_ops import needed_kv  # noqa: E402
from perf.machine import header  # noqa: E402

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


def unfilled(model, kv_dtype: str, batch: int, context: int):
    """A cache with `batch` sequences allocated up to `context` (+1 for the step), not prefilled."""
    block_size = max(64, *model.cfg.compress_ratios)  # a multiple of every compress ratio
    blocks = batch * (-(-(context + 2) // block_size) + 1) + 4
    chunk = 1024  # allocated the way a chunked prefill would (the sliding blocks recycle)
    cache = KVCache.for_model(model, kv_dtype, max_num_seqs=batch, max_tokens_per_step=chunk,
                              num_full_blocks=blocks, block_size=block_size)
    rows = []
    for i in range(batch):
        seq = cache.new_sequence()
        for start in range(0, context + 1, chunk):
            assert cache.allocate(seq, start, min(start + chunk, context + 1)), "KV pool too small"
        rows.append(StepSeq(seq, context, [7 + i]))
    return cache, rows


def sampling_step(logits: torch.Tensor) -> None:
    """The step's sampling at B rows (temperature 0.8, top-p 0.9, seeded) and its one read back."""
    b = logits.shape[0]
    rows = SamplingRows([SamplingParams(temperature=0.8, top_p=0.9, seed=1)] * b, [1] * b, list(range(b)),
                        logits.device)
    keys = counter_rng.row_keys(rows.seeds, rows.counters, counter_rng.SAMPLE)
    sample_device(probs_device(logits.float(), rows), keys).cpu()


@contextmanager
def routed_weight_bytes(total: list[int]):
    """Adds to total[0] the bytes of the routed experts each grouped GEMM reads (those with rows)."""
    fn = linear.GroupedWeight.grouped_mm

    def counted(self, x, ends, *args, **kwargs):
        rows = torch.diff(ends.long(), prepend=ends.new_zeros(1).long())
        stored = sum(t.numel() * t.element_size() for t in (self.weight, self.scale) if t is not None)
        total[0] += stored * int((rows > 0).sum()) // max(1, ends.numel())
        return fn(self, x, ends, *args, **kwargs)

    linear.GroupedWeight.grouped_mm = counted
    try:
        yield
    finally:
        linear.GroupedWeight.grouped_mm = fn


def device_launches(step, model) -> int | None:
    """Kernels (and memcpys/memsets) one uncaptured step puts on a CUDA device; None on CPU."""
    if model.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.run(model, None)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def copy_bandwidth(device: torch.device) -> float:
    """Device copy bandwidth, bytes read + written per second (a 1 GiB copy on CUDA, 256 MiB on CPU)."""
    n = (1 << 30 if device.type == "cuda" else 1 << 28) // 4
    src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync()
    return 5 * 2 * 4 * n / (time.perf_counter() - t0)


@torch.inference_mode()
def measure(model, kv_dtype: str, batch: int, context: int, steps: int) -> dict:
    """One (batch, context) point: step seconds (no timers inside; graph replay on CUDA), seconds
    per component (timers inside), launches per step (CUDA), KV bytes the step needs and routed
    expert bytes it reads."""
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
    timers, moe_bytes = Timers(sync), [0]
    step = StaticDecodeBackend(model, cache, (batch,), (1,), context + 64, capture=False, fused=True).prepare(rows)
    launches = device_launches(step, model)
    with timed_parts(timers), routed_weight_bytes(moe_bytes):
        for _ in range(steps):
            with timers.region("host/other"):
                _, logits = step.run(model, None)
                with timers.region("sampling"):
                    sampling_step(logits)
    parts = {name: timers.total[name] / steps for name in COMPONENTS}
    return {"step": plain, "parts": parts, "launches": launches, "moe_bytes": moe_bytes[0] / steps,
            "kv_bytes": needed_kv(cache, rows, 1, model.cfg.index_topk)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="checkpoint preset (engine/checkpoint.py)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536, 262144])
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8", "fp4"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(header("bench_step_breakdown"), flush=True)
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = build(args.preset, args.device)
    cfg = model.cfg
    copy = copy_bandwidth(model.device)
    print(f"{args.device} | torch {torch.__version__} | preset {args.preset}: {cfg.num_layers} layers "
          f"{list(cfg.layer_kinds)}, index top-k {cfg.index_topk}, kv {args.kv_dtype} | copy bandwidth "
          f"{copy / 1e9:.1f} GB/s (read + write)")
    print("shares: of the timed step (exclusive timers; see the module docstring). KV GB/s: the records the "
          "step needs / (attention + indexer + compressor time); MoE GB/s: routed expert bytes read / MoE time")
    print(f"\n{'batch':>5s} {'context':>8s} {'step ms':>9s} {'vs first':>8s} {'launch':>6s} "
          + " ".join(f"{c:>10s}" for c in COMPONENTS) + f" {'KV GB/s':>8s} {'MoE GB/s':>8s}")
    for batch in args.batches:
        first = None
        for context in args.contexts:
            r = measure(model, args.kv_dtype, batch, context, args.steps)
            first = first or r["step"]
            parts = r["parts"]
            timed = sum(parts.values())
            kv_time = parts["attention"] + parts["indexer"] + parts["compressor"]
            launches = "-" if r["launches"] is None else str(r["launches"])
            print(f"{batch:5d} {context:8d} {r['step'] * 1e3:9.2f} {r['step'] / first:7.2f}x {launches:>6s} "
                  + " ".join(f"{100 * parts[c] / timed:9.1f}%" for c in COMPONENTS)
                  + f" {r['kv_bytes'] / kv_time / 1e9:8.3g} {r['moe_bytes'] / max(parts['MoE'], 1e-12) / 1e9:8.3g}",
                  flush=True)


if __name__ == "__main__":
    main()
