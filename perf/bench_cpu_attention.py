"""CPU decode attention: the numba kernel (kernels/cpu_attention.py) against the torch reference
(kernels/triton/sparse_mla_decode.py), side by side in one run, at decode shapes.

H = 16 heads, D = 512, bf16 raw pools (the CPU default), a shared window table of W = 128 slots
(as engine/v4/step_meta.py builds it) plus K per-row entry slots (0: SWA layers; 512: a CSA layer's
top-k), this step's own keys, B = 1 / 16 sequences × q = 1 / 3 tokens, one thread. Prints µs per
call (median, Python overhead included) and the speed-up.

    python -m perf.bench_cpu_attention [--repeats N]
"""
from __future__ import annotations

import argparse

import torch

from kernels.cpu_attention import sparse_mla_decode
from kernels.triton.sparse_mla_decode import sparse_mla_decode_reference
from perf.machine import header, median_s, set_cpu_threads

HEADS, DIM, WINDOW, PER_BLOCK = 16, 512, 128, 64


def case(b: int, q: int, k: int, seed: int = 0) -> dict:
    """Random bf16 pools and tables: token t sees window columns ≥ t (shared), K random entries."""
    g = torch.Generator().manual_seed(seed)
    blocks = max(8, b * (WINDOW + k) // PER_BLOCK + 2)
    n = blocks * PER_BLOCK
    pool = (torch.randn(n, DIM, generator=g) * 0.5).bfloat16().view(blocks, PER_BLOCK, DIM)
    window = torch.randint(0, n, (b, 1, WINDOW), generator=g, dtype=torch.int32)
    sees = torch.arange(WINDOW) >= torch.arange(q)[:, None]                 # [q, W]
    args = dict(q=torch.randn(b, q, HEADS, DIM, generator=g).bfloat16(), sink=torch.randn(HEADS, generator=g),
                window_pool=pool, window_fmt="bf16", window_slots=torch.where(sees, window, -1),
                new_kv=torch.randn(b, q, DIM, generator=g).bfloat16(), scale=DIM**-0.5, window_shared=True)
    if k:
        args.update(entry_pool=pool, entry_fmt="bf16",
                    entry_slots=torch.randint(0, n, (b, q, k), generator=g, dtype=torch.int32))
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    repeats = parser.parse_args().repeats
    set_cpu_threads(1)
    print(header("sparse_mla_decode, CPU, 1 thread"))
    print(f"# H={HEADS} D={DIM} W={WINDOW} bf16 pools; µs per call (median of {repeats})")
    print(f"{'B':>3} {'q':>2} {'K':>4} {'numba µs':>10} {'reference µs':>13} {'speed-up':>9}")
    for b in (1, 16):
        for q in (1, 3):
            for k in (0, 512):
                args = case(b, q, k)
                ours = sparse_mla_decode(**args)
                ref = sparse_mla_decode_reference(**args)
                assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)
                t_ours = median_s(lambda: sparse_mla_decode(**args), repeats)
                t_ref = median_s(lambda: sparse_mla_decode_reference(**args), max(3, repeats // 3))
                print(f"{b:>3} {q:>2} {k:>4} {t_ours * 1e6:>10.1f} {t_ref * 1e6:>13.1f} {t_ref / t_ours:>8.1f}x")


if __name__ == "__main__":
    main()
