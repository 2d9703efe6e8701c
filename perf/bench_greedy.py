"""A greedy CPU step's argmax: kernels/cpu_sampling.py's block pass against the previous scalar one.

Every greedy decode step on CPU reads each row's whole vocabulary once for its first maximum and
its finiteness (`greedy_rows`). The previous pass, kept here as the baseline, compared element by
element (a scalar loop: ~1 ns an element); the current one checks the exponents with integer
compares and takes eight running maxima a block of 256 (both vectorise), then rescans one block.
Rows of random logits, then the same rows with NaN or infinity (the current pass's scalar
fallback). Prints µs per call, previous / current, and whether the tokens and flags agree.

    python perf/bench_greedy.py [--threads 2] [--vocab 1000 16384 32000 129280] [--rows 1 16]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu_sampling import PARALLEL_GREEDY_ROWS  # noqa: E402
from kernels import cpu_sampling  # noqa: E402
from perf.machine import header, set_cpu_threads  # noqa: E402


@njit(cache=True)
def _greedy_rows_previous(logits, rows, token, finite):
    """The previous `greedy_rows`: one scalar pass per row, argmax and finiteness together."""
    for i in range(rows.shape[0]):
        row = logits[rows[i]]
        best, at = row[0], 0
        nan = best != best
        ok = math.isfinite(best)
        for j in range(1, row.shape[0]):
            v = row[j]
            if not math.isfinite(v):
                ok = False
            if not nan:
                if v != v:
                    at, nan = j, True
                elif v > best:
                    best, at = v, j
        token[i], finite[i] = at, ok


def _time(fn, args, repeats: int) -> float:
    fn(*args)                                                  # numba's cache
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, nargs="+", default=[1000, 16384, 32000, 129280])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=501)
    args = parser.parse_args()
    print(header("bench_greedy"), flush=True)
    set_cpu_threads(args.threads)
    print(f"# {args.threads} thread(s); medians of {args.repeats} calls, 3 interleaved rounds; current = "
          f"greedy_rows (greedy_rows_parallel from {PARALLEL_GREEDY_ROWS} rows, as the engine picks)")
    print(f"{'vocab':>7s} {'rows':>4s} {'logits':>8s} {'previous us':>12s} {'current us':>11s} {'prev/cur':>9s}  agree")
    g = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        for m in args.rows:
            for kind in ("finite", "nan/inf"):
                logits = torch.randn(m, vocab, generator=g)
                if kind != "finite":
                    logits[:, vocab // 2] = float("inf")
                    logits[::2, vocab // 3] = float("nan")
                x, rows = logits.numpy(), np.arange(m, dtype=np.int64)
                outs = [(np.empty(m, np.int64), np.empty(m, np.bool_)) for _ in range(2)]
                current = (cpu_sampling.greedy_rows_parallel if m >= PARALLEL_GREEDY_ROWS
                           else cpu_sampling.greedy_rows)
                times: list[list[float]] = [[], []]
                for _ in range(3):
                    for side, fn in enumerate((_greedy_rows_previous, current)):
                        times[side].append(_time(fn, (x, rows, *outs[side]), args.repeats))
                agree = all(np.array_equal(a, b) for a, b in zip(*outs))
                p, c = (1e6 * statistics.median(t) for t in times)
                print(f"{vocab:7d} {m:4d} {kind:>8s} {p:12.1f} {c:11.1f} {p / c:8.2f}x  {'yes' if agree else 'NO'}",
                      flush=True)


if __name__ == "__main__":
    main()
