"""kernels/cpu_indexer.py (numba) against the torch reference it replaces, side by side, one thread.

V4-Flash decode shapes: Hi = 64 index heads x dI = 128, top-k 512, ratio 4; B = 1 and 16
sequences, q = 1 (and q = 2, a verify step), 600 / 2048 / 16384 visible entries each, fp4_index
and bf16 key pools of 64-entry blocks, shuffled tables; the table is as wide as the entries
(max_entries = visible count, as engine/v4/fused_decode.py passes batch.max_context // m), so the
reference's padding waste is not in these numbers. Prints medians per call including the
Python wrappers, and reference / numba ratios.

    python -m perf.bench_cpu_indexer [--repeats N] [--quick]
"""
from __future__ import annotations

import argparse

import torch

from kernels import cpu_indexer, cpu_kv
from kernels.formats import get_format
from kernels.triton.indexer_topk import indexer_topk_reference
from perf.machine import header, median_s, set_cpu_threads

PER_BLOCK = 64


def case(b: int, q: int, n: int, fmt: str, hi: int = 64, di: int = 128, seed: int = 0) -> dict:
    """b sequences of n visible entries each, blocks shuffled over a pool with one spare block."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-n // PER_BLOCK)
    blocks = b * per_seq + 1
    table = (torch.randperm(blocks - 1, generator=g)[:b * per_seq] + 1).view(b, per_seq).int()
    keys = torch.randn(blocks * PER_BLOCK, di, generator=g)                       # [S, dI]
    if fmt == "bf16":
        pool = keys.bfloat16().view(blocks, PER_BLOCK, di)
    else:
        pool = torch.zeros(blocks, PER_BLOCK, get_format(fmt, di).record_bytes, dtype=torch.uint8)
        cpu_kv.quantize_scatter(keys, pool, torch.arange(blocks * PER_BLOCK), fmt)
    positions = 4 * n + torch.arange(q).expand(b, q) - q + 3                       # last row sees n
    return dict(q=torch.randn(b, q, hi, di, generator=g).bfloat16(), weights=torch.randn(b, q, hi, generator=g),
                pool=pool, fmt=fmt, block_table=table, lengths=torch.full((b,), n), positions=positions,
                ratio=4, topk=512, max_entries=n, weight_scale=hi**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="skip the B = 16, 16384-entry shapes")
    args = parser.parse_args()
    set_cpu_threads(1)
    print(header("indexer_topk, numba vs torch reference, 1 thread"))
    for fmt in ("fp4_index", "bf16"):
        for b, q in ((1, 1), (1, 2), (16, 1)):
            for n in (600, 2048, 16384):
                if args.quick and b == 16 and n == 16384:
                    continue
                x = case(b, q, n, fmt)
                ref = median_s(lambda: indexer_topk_reference(**x), args.repeats)
                ours = median_s(lambda: cpu_indexer.indexer_topk(**x), args.repeats)
                print(f"{fmt:<9} B={b:<3} q={q} n={n:<6} reference {ref * 1e3:9.2f} ms   numba {ours * 1e3:8.2f} ms"
                      f"   x{ref / ours:6.1f}")


if __name__ == "__main__":
    main()
