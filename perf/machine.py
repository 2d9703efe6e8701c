"""What every benchmark prints first: the machine it ran on (the CPU model changes between
machines, and figures from different CPUs are not comparable), its thread budget, and how the
kernel benchmarks time one call."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def header(what: str = "") -> str:
    """One line: CPU, usable cores, load average, torch version (if imported), GPU (if any)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    parts = [f"CPU: {cpu_model()}", f"{cores} usable cores", f"load {load}"]
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.append(f"GPU: {torch.cuda.get_device_name()}")
    except ImportError:
        pass
    return "# " + (what + " — " if what else "") + "; ".join(parts)


def set_cpu_threads(n: int) -> None:
    """Use `n` threads in torch and numba alike (numba's pool would otherwise take every core
    and reset torch's count when it starts). numba sizes its OpenMP pool once, from
    NUMBA_NUM_THREADS, at import: a pool larger than `n` keeps its idle threads spinning after
    every parallel kernel, which took ~40 % longer decode steps on a 2-core machine with the
    other core busy. A worker avoids it (server/worker_entry.py pins the pool before numba is
    imported); a benchmark run with fewer threads than cores warns, so run it as
    `NUMBA_NUM_THREADS=n OMP_NUM_THREADS=n python perf/...` to measure what a worker runs."""
    import numba
    import torch

    if numba.config.NUMBA_NUM_THREADS > n:
        print(f"# warning: numba's pool has {numba.config.NUMBA_NUM_THREADS} threads for {n} used; "
              f"set NUMBA_NUM_THREADS={n} OMP_NUM_THREADS={n} to time what a {n}-thread worker runs", file=sys.stderr)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    torch.set_num_threads(n)


def median_s(fn: Callable[[], object], repeats: int, cuda: bool = False) -> float:
    """Median seconds of one call of `fn` over `repeats` calls after one warm-up (numba cache,
    Triton / NVRTC compile); `cuda`: timed by CUDA events around each call."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
