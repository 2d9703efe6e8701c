"""CPU decode step of one checkpoint: the decode paths and kernels side by side, in one run.

Variants, each an Engine on the same loaded weights (batch B: B prompts of --prompt-len prefilled
in one step, then --steps decode steps; ms per decode step, a token per sequence, and ms for
that prefill step):
  default  the engine on CPU with exact fp32 matmuls: decode steps on the static shapes, compiled
           calls with the LM head inside (kernels/cpu_step.py) where they cover the shape (fp32,
           raw KV, <= 16 rows), else the fused forward op by op; these greedy requests run up to
           --cpu-decode-steps (4) steps per call, the argmax inside it; weights kept FP8/FP4 on
           the fused row kernels
  one-step as default with one decode step per call (--cpu-decode-steps 1), the argmax on the host;
           the variants below run one step per call too (scalar-argmax against this one)
  ops-step the static fused forward op by op (engine/v4/fused_decode.py with the numba kernels of
           kernels/cpu_decode.py; FusedDecoder.cpu_step off): the path before the compiled step
  ref-ops  as default, with kernels/cpu_decode.py's ops swapped for their torch references
           (kernels/decode_reference.py): what the numba kernels save
  per-seq  decode steps on the per-sequence path (`static_decode=False`, engine/v4/attention.py's
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
  scalar-argmax  as one-step with a greedy step's argmax the previous scalar pass
           (perf/bench_greedy.py's baseline) instead of kernels/cpu_sampling.py's block pass
Rounds interleave the variants (default, ref-ops, …) so a busy neighbour slows them alike;
medians over --rounds. Ratios are variant / default (> 1: the default is faster). Rows: wall ms
per decode step, wall ms of the prefill, and this process's CPU ms per decode step ("dec cpu":
without the waits for a core, the figure to compare on a machine others share). --dtype is the
compute dtype (fp32: what `ringserve serve` runs on CPU).

Then, per batch, where the default decode step goes (medians of --rounds runs), in wall and in this process's CPU milliseconds per step: the engine's
decode step; the model's static replay (forward and logits, StaticDecodeBackend.replay, or
run_greedy for multi-step calls); the time inside the compiled call (`run_step`) and its share of the step (the rest is Python and dispatch:
the engine's scheduling, sampling and output, and the op calls around the compiled step). CPU
time leaves out the waits for a core when other work shares the machine, so at --threads 1 its
share is the robust one (with more threads it also counts the helpers' spinning). And the
roofline: the weight bytes the step must read (StepProgram.weight_bytes; not the KV cache the
attention reads), the rate the compiled call reads them at, and how long they take at this
thread's read rate (measured on a DRAM-sized and an L3-sized array) against the call's time.

    python perf/bench_cpu_decode.py --model-dir .peer-cache/models/issue41 [--batch 1 16] [--threads 1]
        [--variants ops-step ref-ops per-seq tiled bf16] [--dtype fp32]
    (.peer-cache/models/NAME: python perf/peer_llamacpp.py make-model DIR --geometry NAME)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from pathlib import Path

import numba
import numpy as np
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import StaticDecodeBackend
from engine.engine import Engine
from engine.linear import QuantWeight
from engine.v4.fused_decode import FusedDecoder
from engine.weights import load_model
from ipc.messages import SamplingParams
from kernels import cpu_decode, cpu_quant_gemm, cpu_sampling, cpu_step_plan
from kernels.cpu_precision import matmul_precision
from perf.bench_quant_gemm import tiled
from perf.machine import header, set_cpu_threads

VARIANTS = ["default", "one-step", "ops-step", "ref-ops", "per-seq", "tiled", "ops-moe", "generic", "bf16", "bf16-mm",
            "scalar-argmax"]
# one decode step per engine step (--cpu-decode-steps 1): the op paths have no multi-step call, and
# scalar-argmax swaps the host's argmax, which a multi-step call does not use
ONE_STEP_VARIANTS = {"one-step", "ops-step", "ref-ops", "per-seq", "tiled", "ops-moe", "generic", "bf16-mm",
                     "scalar-argmax"}


def step_ms(model, batch: int, prompt_len: int, steps: int, static: bool = True, decode_steps: int | None = None,
            on_decode=None) -> tuple[float, float, float]:
    """(wall ms per decode step, wall ms of the prefill step before them, this process's CPU ms per
    decode step, the first engine step after the prefill left out: one measurement. A decode
    step is one token per sequence, however many of them one engine step runs (the engine's
    --cpu-decode-steps, `decode_steps`: None = its default). on_decode(engine, decode steps):
    called before (0) and after the decode steps."""
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
                          num_kv_blocks=batch * (-(-(prompt_len + steps) // 256) + 2) + 4,
                          block_size=256, speculative_tokens=0,
                          max_model_len=prompt_len + steps + 8, static_decode=static)
    if decode_steps is not None:
        config = dataclasses.replace(config, cpu_decode_steps=decode_steps)
    engine = Engine(model, config)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(3, model.cfg.vocab_size - 1, (prompt_len,), generator=g).tolist()
        engine.add_request(i, prompt, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()                                            # the prefill (every prompt fits one step)
    prefill_ms = 1000 * (time.perf_counter() - t0)
    engine.step()          # the first decode step builds its shape's compiled program: once per shape, not per step
    if on_decode is not None:
        on_decode(engine, 0)                                 # the prefill's share is not the decode's
    t0, c0, n = time.perf_counter(), time.process_time(), 0
    while engine.has_work:
        n += sum(len(d.token_ids) for d in engine.step().deltas if d.request_id == 0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if on_decode is not None:
        on_decode(engine, n)
    return 1000 * wall / max(n, 1), prefill_ms, 1000 * cpu / max(n, 1)


@contextlib.contextmanager
def switched(cls, name: str, value):
    """cls.name = value for the duration (a FusedDecoder / QuantWeight switch, a kernel module's function)."""
    saved = getattr(cls, name)
    setattr(cls, name, value)
    try:
        yield
    finally:
        setattr(cls, name, saved)


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


def run_variant(name: str, models: dict, batch: int, args) -> tuple[float, float, float]:
    def run() -> tuple[float, float, float]:
        return step_ms(models["bf16" if name == "bf16" else "auto"], batch, args.prompt_len, args.steps,
                       static=name != "per-seq", decode_steps=1 if name in ONE_STEP_VARIANTS else None)
    if name == "ref-ops":
        with reference_ops(), switched(FusedDecoder, "cpu_step", False):
            return run()
    if name == "ops-moe":
        with moe_op_by_op(), switched(FusedDecoder, "cpu_step", False):
            return run()
    if name == "ops-step":
        with switched(FusedDecoder, "cpu_step", False):
            return run()
    if name == "generic":
        with generic_products(), switched(FusedDecoder, "cpu_step", False):
            return run()
    if name == "scalar-argmax":
        from perf.bench_greedy import _greedy_rows_previous
        with switched(cpu_sampling, "greedy_rows", _greedy_rows_previous), \
                switched(cpu_sampling, "greedy_rows_parallel", _greedy_rows_previous):
            return run()
    if name == "bf16-mm":
        with matmul_precision("bf16"), switched(FusedDecoder, "cpu_step", False):
            return run()
    if name == "tiled":
        with switched(FusedDecoder, "cpu_step", False):
            return tiled(run)()
    return run()


class StepClock:
    """Time inside the compiled call (kernels.cpu_step_plan.launch: run_step), in the model's static
    replay and in the whole decode loop of an engine, each as wall seconds and as this process's
    CPU seconds. On a machine whose cores other work shares, wall time includes the waits for a
    core; CPU time does not, so at one thread the CPU shares are the robust ones."""

    def __init__(self):
        self.kernel = [0.0, 0.0]          # [wall, cpu]
        self.model = [0.0, 0.0]
        self.decode = [0.0, 0.0]
        self._t0 = (0.0, 0.0)
        self.steps = 0
        self.program = None

    @staticmethod
    def _timed(fn, into: list):
        def timed(*args):
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args)
            finally:
                into[0] += time.perf_counter() - w0
                into[1] += time.process_time() - c0
        return timed

    @contextlib.contextmanager
    def installed(self):
        real_run, real_replay, real_greedy = cpu_step_plan.launch, StaticDecodeBackend.replay, StaticDecodeBackend.run_greedy
        cpu_step_plan.launch = self._timed(real_run, self.kernel)
        StaticDecodeBackend.replay = self._timed(real_replay, self.model)
        StaticDecodeBackend.run_greedy = self._timed(real_greedy, self.model)
        try:
            yield self
        finally:
            cpu_step_plan.launch, StaticDecodeBackend.replay = real_run, real_replay
            StaticDecodeBackend.run_greedy = real_greedy

    def on_decode(self, engine, steps: int) -> None:
        if steps == 0:                                   # the decode loop starts: the prefill's time is not its
            self.kernel[:] = self.model[:] = [0.0, 0.0]
            self._t0 = (time.perf_counter(), time.process_time())
            return
        self.decode = [time.perf_counter() - self._t0[0], time.process_time() - self._t0[1]]
        self.steps = steps
        programs = [p for _, p in engine.static.fused._programs.values() if p is not None]
        self.program = max(programs, key=lambda p: p.rows, default=None)


@numba.njit(cache=True, fastmath={"reassoc"})
def _read(a):
    s = np.float32(0)
    for i in range(a.shape[0]):
        s += a[i]
    return s


def read_gb_s(nbytes: int, repeats: int = 5) -> float:
    """This thread's read rate over an fp32 array of `nbytes` (median of `repeats` passes, CPU time)."""
    a = np.ones(nbytes // 4, np.float32)
    _read(a)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        _read(a)
        times.append(time.process_time() - t0)
    return nbytes / statistics.median(times) / 1e9


def breakdown(models: dict, batch: int, args, dram: float, l3: float) -> str:
    """One line: where the default decode step of `batch` goes (medians over --rounds runs), in
    wall and in CPU milliseconds per step."""
    variant = "default"
    rows = []
    for _ in range(args.rounds):
        clock = StepClock()
        with clock.installed():
            step_ms(models["auto"], batch, args.prompt_len, args.steps, on_decode=clock.on_decode)
        n = max(clock.steps, 1)
        rows.append([1000 * v / n for v in (*clock.decode, *clock.model, *clock.kernel)] + [clock.program])
    step, step_cpu, model, model_cpu, kernel, kernel_cpu = (statistics.median(r[i] for r in rows) for i in range(6))
    program = rows[-1][6]
    if program is None or kernel == 0:
        return f"{variant:>8s} {batch:5d} {step:8.2f} {step_cpu:8.2f}   (no compiled step at this batch: op path)"
    mb = sum(program.weight_bytes(with_logits=True).values()) / 1e6
    return (f"{variant:>8s} {batch:5d} {step:8.2f} {kernel:8.2f} {100 * kernel / step:6.1f}% {step_cpu:8.2f} "
            f"{model_cpu:8.2f} {kernel_cpu:8.2f} {100 * kernel_cpu / step_cpu:6.1f}% "
            f"{mb:8.2f} {mb / kernel_cpu:8.1f} {mb / dram:8.2f} {mb / l3:8.2f} {100 * mb / l3 / kernel_cpu:6.1f}%")


def cpu_detail() -> str:
    """Family / model numbers, caches and the vector extensions the kernels can use (the model
    name alone, e.g. "AMD EPYC", does not say which generation)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "cpu details unknown"
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in info.get("flags", "").split()]
    caches = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, size = (index / "level").read_text().strip(), (index / "size").read_text().strip()
            kind = (index / "type").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction":
            caches.append(f"L{level} {size}")
    return (f"{info.get('vendor_id', '?')} family {info.get('cpu family', '?')} model {info.get('model', '?')}; "
            f"{', '.join(caches) or 'caches unknown'}; {' '.join(flags) or 'no AVX2'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--variants", nargs="+", default=VARIANTS[1:], choices=VARIANTS,
                        help="default is always run (the baseline)")
    args = parser.parse_args()
    print(header("bench_cpu_decode"), flush=True)
    print(f"# {cpu_detail()}", flush=True)
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
        times: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name in variants:
                times[name].append(run_variant(name, models, batch, args))
        for i, phase in enumerate(("decode", "prefill", "dec cpu")):
            med = {v: statistics.median(t[i] for t in ts) for v, ts in times.items()}
            print(f"{batch:5d} {phase:>7s} " + " ".join(f"{med[v]:10.1f}" for v in variants) + " "
                  + " ".join(f"{med[v] / med['default']:15.2f}x" for v in others), flush=True)
    dram, l3 = read_gb_s(512 << 20), read_gb_s(16 << 20)
    print(f"# where the decode step goes (ms per step, medians of {args.rounds}): wall, then this process's CPU "
          f"time (the robust figures on shared cores); kernels = inside the compiled call (run_step), share = "
          f"kernels / step, the rest Python and dispatch (engine, sampling, ops around the call); model = the "
          f"static replay (forward + logits; a multi-step call's steps). Roofline: the weight MB a step must read, the rate the call reads "
          f"them at (CPU time), and their time at this thread's read rate: {dram:.1f} GB/s from a 512 MiB array "
          f"(DRAM), {l3:.1f} GB/s from 16 MiB (L3); roof = ms@16MiB / kernels cpu")
    print(f"{'variant':>8s} {'batch':>5s} {'step':>8s} {'kernels':>8s} {'share':>7s} {'step cpu':>8s} {'model cpu':>8s} "
          f"{'kern cpu':>8s} {'share':>7s} {'weight MB':>8s} {'GB/s':>8s} {'ms@DRAM':>8s} {'ms@16MiB':>8s} {'roof':>7s}")
    for batch in args.batch:
        print(breakdown(models, batch, args, dram, l3), flush=True)


if __name__ == "__main__":
    main()
