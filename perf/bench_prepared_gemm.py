"""Per-call cost of a decode-sized quantized CPU product: the generic kernel entry point against
the prepared weight (kernels/cpu_prepared_gemm.py), side by side in one run.

Shapes are a DeepSeek-V4 layer's at the given sizes (default: the tiny V4 of perf/peer_llamacpp.py):
the shared expert's w2 (FP8, the smallest), wq_b (FP8), wo_a's groups (grouped FP8) and the
routed experts' w13 (grouped FP4, batch-1 routing: k experts with one row each). Each call
gets the next of --cold copies of the weight, as a decode step reads each weight once. Rounds
are interleaved; medians of --repeats; the outputs of both paths are compared bit for bit.

    python perf/bench_prepared_gemm.py [--hidden 256] [--repeats 9] [--calls 200] [--cold 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from perf.machine import header, set_cpu_threads  # noqa: E402


def fp8_weight(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes [..., N, K] (no NaN codes) and ue8m0 scales per 128x128 block."""
    codes = (torch.randn(shape, generator=g) * 32).clamp(-448, 448).to(torch.float8_e4m3fn)
    *lead, n, k = shape
    scale = torch.randint(118, 128, (*lead, -(-n // 128), -(-k // 128)), generator=g, dtype=torch.uint8)
    return codes, scale.view(torch.float8_e8m0fnu)


def fp4_weight(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed e2m1 pairs [..., N, K/2] and ue8m0 scales per row and 32 columns."""
    *lead, n, k = shape
    packed = torch.randint(-128, 128, (*lead, n, k // 2), generator=g, dtype=torch.int8)
    scale = torch.randint(118, 128, (*lead, n, k // 32), generator=g, dtype=torch.uint8)
    return packed, scale.view(torch.float8_e8m0fnu)


def cases(hidden: int, experts: int, top_k: int, inter: int, q_out: int, wo_in: int, groups: int,
          g: torch.Generator) -> dict:
    """name -> (kind, shape, generic(x, w, s), prepared(p, x), x)."""
    ends = torch.zeros(experts, dtype=torch.int32)
    picked = torch.randperm(experts, generator=g)[:top_k].sort().values
    for i, e in enumerate(picked.tolist()):
        ends[e:] = i + 1                                    # one row for each of the k experts
    group_ends = torch.arange(1, groups + 1, dtype=torch.int32)
    return {
        "shared w2 fp8": ("fp8", (hidden, inter), lambda x, w, s: kernels.fp8_linear(x, w, s),
                          lambda p, x: p.linear(x), torch.randn(1, inter, generator=g)),
        "wq_b fp8": ("fp8", (q_out, hidden), lambda x, w, s: kernels.fp8_linear(x, w, s),
                     lambda p, x: p.linear(x), torch.randn(1, hidden, generator=g)),
        "wo_a fp8 grouped": ("fp8", (groups, hidden, wo_in),
                             lambda x, w, s: kernels.fp8_grouped_mm(x, w, s, group_ends),
                             lambda p, x: p.grouped(x, group_ends), torch.randn(groups, wo_in, generator=g)),
        "w13 fp4 grouped": ("fp4", (experts, 2 * inter, hidden),
                            lambda x, w, s: kernels.fp4_grouped_mm(x, w, s, ends),
                            lambda p, x: p.grouped(x, ends), torch.randn(top_k, hidden, generator=g)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--inter", type=int, default=128)
    parser.add_argument("--q-out", type=int, default=8192, help="heads x head_dim")
    parser.add_argument("--groups", type=int, default=4, help="wo_a groups")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cold", type=int, default=8, metavar="N", help="cycle through N copies of each weight")
    args = parser.parse_args()
    print(header("bench_prepared_gemm"), flush=True)
    set_cpu_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"# one thread; {args.calls} calls a round, medians of {args.repeats} interleaved rounds; "
          f"{args.cold} copies of each weight")
    print(f"{'product':>18s} {'weight':>16s} {'generic us':>11s} {'prepared us':>12s} {'generic/prepared':>17s}  outputs")
    wo_in = args.q_out // args.groups
    for name, (kind, shape, generic, prepared, x) in cases(args.hidden, args.experts, args.top_k, args.inter,
                                                           args.q_out, wo_in, args.groups, g).items():
        make = fp8_weight if kind == "fp8" else fp4_weight
        copies = [make(shape, g) for _ in range(args.cold)]
        block = (128, 128) if kind == "fp8" else (1, 32)
        preps = [kernels.prepare_quant_weight(w, s, kind, block) for w, s in copies]
        runs = {"generic": lambda i: generic(x, *copies[i % len(copies)]),
                "prepared": lambda i: prepared(preps[i % len(preps)], x)}
        outs = {v: run(0) for v, run in runs.items()}
        times = {v: [] for v in runs}
        for _ in range(args.repeats):
            for v, run in runs.items():
                t0 = time.perf_counter()
                for i in range(args.calls):
                    run(i)
                times[v].append((time.perf_counter() - t0) / args.calls * 1e6)
        med = {v: statistics.median(ts) for v, ts in times.items()}
        same = torch.equal(outs["generic"].view(torch.int32), outs["prepared"].view(torch.int32))
        print(f"{name:>18s} {'x'.join(map(str, shape)):>16s} {med['generic']:11.1f} {med['prepared']:12.1f} "
              f"{med['generic'] / med['prepared']:16.2f}x  {'identical' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
