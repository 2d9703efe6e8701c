"""The tiled FP8 path's tile size, under each CPU matmul precision, side by side in one run.

kernels/cpu_quant_gemm.py decodes a prefill-sized FP8 product's weight tile by tile into fp32
and hands each tile to torch's mm. With bf16 operands (kernels/cpu_precision.py) oneDNN converts
both operands on every mm, the activation once per tile, so the tile's size matters more there
than under exact fp32. This times `_fp8_mm` on projections of the tiny V4s (the peer sweep's
geometries, perf/peer_llamacpp.py) at several tile sizes; each round calls every size once, in
turn (perf/bench_quant_gemm.py's interleaved_medians), medians of --repeats. The last columns
are the ratios against the 2 MiB tile (TILE_BYTES); the tile the library picks is
BF16_TILE_BYTES where the product takes bf16 operands, TILE_BYTES otherwise.

    python -m perf.bench_tile_size [--precision bf16 fp32] [--rows 16 128 2048] [--repeats 11]
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kernels import cpu_precision, cpu_quant_gemm
from perf.bench_quant_gemm import interleaved_medians
from perf.machine import header, set_cpu_threads

# (N, K) of FP8 projections in the tiny V4s: wo_b (K = o_groups · o_lora_rank), wq_b, wq_a.
SHAPES = [(1024, 4096), (2048, 768), (2048, 512), (768, 1024), (512, 1024)]
TILE_MIB = (2, 4, 8, 32)


def with_tile(mib: int, fn: Callable[[], object]) -> Callable[[], object]:
    """fn with both tile sizes (exact and bf16 operands) set to `mib` MiB for the call."""
    def run() -> object:
        saved = cpu_quant_gemm.TILE_BYTES, cpu_quant_gemm.BF16_TILE_BYTES
        cpu_quant_gemm.TILE_BYTES = cpu_quant_gemm.BF16_TILE_BYTES = mib << 20
        try:
            return fn()
        finally:
            cpu_quant_gemm.TILE_BYTES, cpu_quant_gemm.BF16_TILE_BYTES = saved
    return run


def time_tiles(m: int, n: int, k: int, repeats: int) -> dict[int, float]:
    """Median seconds of one [m, k] @ fp8 [n, k]^T tiled product per tile size (MiB)."""
    g = torch.Generator().manual_seed(m + n + k)
    weight = (torch.randn(n, k, generator=g) * 0.05).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.02 + 0.005
    a = torch.randn(m, k, generator=g)
    product = lambda: cpu_quant_gemm._fp8_mm(a, weight, scale, (128, 128))  # noqa: E731
    medians = interleaved_medians([with_tile(mib, product) for mib in TILE_MIB], repeats)
    return dict(zip(TILE_MIB, medians))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 128, 2048])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_cpu_threads(args.threads)
    print(header(f"tiled FP8 product by tile size; {args.threads} thread(s), medians of {args.repeats}"))
    print(f"{'precision':>9} {'M':>5} {'N':>5} {'K':>5} " + " ".join(f"{f'{mib} MiB ms':>9}" for mib in TILE_MIB)
          + " " + " ".join(f"{f'{mib}/2 MiB':>8}" for mib in TILE_MIB[1:]))
    for precision in args.precision:
        with cpu_precision.matmul_precision(precision):
            for m in args.rows:
                for n, k in SHAPES:
                    t = time_tiles(m, n, k, args.repeats)
                    print(f"{precision:>9} {m:5d} {n:5d} {k:5d} " + " ".join(f"{t[mib] * 1e3:9.3f}" for mib in TILE_MIB)
                          + " " + " ".join(f"{t[2] / t[mib]:7.2f}x" for mib in TILE_MIB[1:]))


if __name__ == "__main__":
    main()
