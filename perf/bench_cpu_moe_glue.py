"""kernels/cpu_moe_glue.py (numba gather_rows / moe_combine) against the torch references, one thread.

Decode shapes of one MoE layer: T = 1 and 16 tokens, k = 6 experts per token, hidden 256 (the
tiny test model) and 4096 (V4-Flash), bf16 and fp32 activations, with the shared expert's
output added. Prints medians per call including the Python wrappers, and reference / numba
ratios. (swiglu stays on its reference: see kernels/cpu_moe_glue.py.)

    python -m perf.bench_cpu_moe_glue [--repeats N]
"""
from __future__ import annotations

import argparse

import torch

from kernels import cpu_moe_glue
from kernels.triton.moe_ops import gather_rows_reference, moe_combine_reference
from perf.machine import header, median_s, set_cpu_threads

K = 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    set_cpu_threads(1)
    print(header("MoE gather_rows / moe_combine, numba vs torch reference, 1 thread"))
    for dtype in (torch.bfloat16, torch.float32):
        for h in (256, 4096):
            for t in (1, 16):
                g = torch.Generator().manual_seed(0)
                x = torch.randn(t, h, generator=g).to(dtype)
                order = torch.randperm(t * K, generator=g).int()
                y = torch.randn(t * K, h, generator=g).to(dtype)
                w = torch.rand(t, K, generator=g)
                shared = torch.randn(t, h, generator=g).to(dtype)
                for name, ref_fn, ours_fn, fn_args in (
                        ("gather", gather_rows_reference, cpu_moe_glue.gather_rows, (x, order, K)),
                        ("combine", moe_combine_reference, cpu_moe_glue.moe_combine, (y, w, order, shared, dtype))):
                    ref = median_s(lambda: ref_fn(*fn_args), args.repeats)
                    ours = median_s(lambda: ours_fn(*fn_args), args.repeats)
                    print(f"{name:<8} {str(dtype)[6:]:<9} H={h:<5} T={t:<3} reference {ref * 1e6:8.1f} µs   "
                          f"numba {ours * 1e6:7.1f} µs   x{ref / ours:5.1f}")


if __name__ == "__main__":
    main()
