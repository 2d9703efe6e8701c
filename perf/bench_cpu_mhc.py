"""kernels/cpu_mhc.py (numba) against the torch references it replaces, side by side, one thread.

Decode shapes of one mHC site: T = 1 and 16 tokens, n = 4 streams, D = 256 (the tiny test model)
and 4096 (V4-Flash's hidden size), bf16 streams, fp32 parameters, 20 Sinkhorn iterations,
mix with the collapse and the block's RMSNorm (as engine/v4/fused_decode.py calls it), then expand.
Prints medians per call including the Python wrappers, and reference / numba ratios.

    python -m perf.bench_cpu_mhc [--repeats N]
"""
from __future__ import annotations

import argparse

import torch

from kernels import cpu_mhc
from kernels.triton.mhc_expand import mhc_expand_reference
from kernels.triton.mhc_mix import mhc_mix_reference
from perf.machine import header, median_s, set_cpu_threads


def _inputs(t: int, d: int, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(streams=torch.randn(t, n, d, generator=g).bfloat16(),
                fn=torch.randn((2 + n) * n, n * d, generator=g) / (n * d) ** 0.5,
                base=0.5 * torch.randn((2 + n) * n, generator=g), scale=1 + 0.2 * torch.randn(3, generator=g),
                norm=1 + 0.1 * torch.randn(d, generator=g), y=torch.randn(t, d, generator=g).bfloat16())


def _row(name: str, t: int, d: int, ref_s: float, ours_s: float) -> str:
    return f"{name:<7} T={t:<3} D={d:<5} reference {ref_s * 1e6:9.1f} µs   numba {ours_s * 1e6:8.1f} µs   x{ref_s / ours_s:6.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    set_cpu_threads(1)
    print(header("mHC mix / expand, numba vs torch reference, 1 thread"))
    for d in (256, 4096):
        for t in (1, 16):
            x = _inputs(t, d)
            mix_args = (x["streams"], x["fn"], x["base"], x["scale"], 20, 1e-6, 1e-6)
            kw = dict(collapse=True, norm_weight=x["norm"], out_eps=1e-6)
            _, post, comb, _ = mhc_mix_reference(*mix_args, **kw)
            ref = median_s(lambda: mhc_mix_reference(*mix_args, **kw), args.repeats)
            ours = median_s(lambda: cpu_mhc.mhc_mix(*mix_args, **kw), args.repeats)
            print(_row("mix", t, d, ref, ours))
            exp_args = (x["streams"], x["y"], post, comb)
            ref = median_s(lambda: mhc_expand_reference(*exp_args), args.repeats)
            ours = median_s(lambda: cpu_mhc.mhc_expand(*exp_args), args.repeats)
            print(_row("expand", t, d, ref, ours))


if __name__ == "__main__":
    main()
