"""Kernel benchmark: each CPU implementation vs its torch reference and vs memcpy bandwidth.

Prints one table. "GB/s" counts the bytes an op must read and write once: for every KV op that
is the bf16 input (N x D x 2 bytes, what quantize reads and dequantize writes) plus the records
(N x record_bytes, what quantize writes and dequantize reads), the same for the paged
scatter/gather (slot array not counted); routing counts logits + outputs. "÷memcpy" divides it by
the measured copy bandwidth of this machine (a 256 MiB torch copy: read + write = 512 MiB moved
per copy), all with torch's/numba's default thread count. Times are medians of --repeats runs
after one warm-up call (which also compiles or loads the numba cache); on a shared machine, run
it several times. With a CUDA device (and CuPy), the CUDA kernels get the same columns against
the GPU copy bandwidth.
Goals (CPU): quantize/dequantize >= 0.3 of memcpy; routing >= 5x the reference at 4096 x 256.
Run: python perf/bench_kernels.py [--rows N] [--repeats R]
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

import kernels
from kernels import cpu_kv, cpu_routing, reference
from kernels.devices import importable
from perf.machine import header, median_s  # noqa: E402

FORMATS = {"bf16": 512, "fp8_ds_mla": 512, "fp4_kv": 512, "fp4_index": 128}


def copy_gbps(device: str, repeats: int) -> float:
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_s(lambda: dst.copy_(src), repeats, device == "cuda") / 1e9


def cases(rows: int, device: str) -> list[tuple[str, int, Callable[[], object]]]:
    """(name, bytes moved, fn) for every op on ``device``."""
    out = []
    for fmt, dim in FORMATS.items():
        x = torch.randn(rows, dim, device=device).bfloat16()
        records = kernels.quantize(x, fmt)
        f = kernels.get_format(fmt, dim)
        pool = torch.zeros(rows // 256 + 1, 256, f.record_bytes, dtype=torch.uint8, device=device)
        slots = torch.randperm(pool.shape[0] * 256, device=device)[:rows]
        moved = x.numel() * 2 + records.numel()
        out += [(f"quantize {fmt}", moved, lambda x=x, fmt=fmt: kernels.quantize(x, fmt)),
                (f"dequantize {fmt}", moved, lambda r=records, fmt=fmt: kernels.dequantize(r, fmt, torch.bfloat16)),
                (f"scatter {fmt}", moved, lambda x=x, p=pool, s=slots, fmt=fmt: kernels.quantize_scatter(x, p, s, fmt)),
                (f"gather {fmt}", moved, lambda p=pool, s=slots, fmt=fmt: kernels.gather_dequantize(p, s, fmt, torch.bfloat16))]
    logits = torch.randn(4096, 256, device=device)
    bias = torch.randn(256, device=device) * 0.1
    _, ids = kernels.route(logits, bias, 6, 1.5)
    out += [("route 4096x256 top6", logits.numel() * 4 + 4096 * 6 * 8,
             lambda: kernels.route(logits, bias, 6, 1.5)),
            ("permute 4096x6 E=256", 4096 * 6 * 4 * 3 + 257 * 4 * 2, lambda: kernels.permute(ids, 256))]
    return out


REFERENCE = {"quantize": reference.quantize, "dequantize": reference.dequantize,
             "scatter": reference.quantize_scatter, "gather": reference.gather_dequantize,
             "route": reference.route, "permute": reference.permute}


def reference_fn(name: str, fn: Callable[[], object]) -> Callable[[], object]:
    """The same call through kernels.reference: swap the dispatch target inside ``fn``."""
    op = name.split()[0]
    public = {"scatter": "quantize_scatter", "gather": "gather_dequantize"}.get(op, op)

    def run() -> object:
        saved = getattr(kernels, public)
        setattr(kernels, public, REFERENCE[op])
        try:
            return fn()
        finally:
            setattr(kernels, public, saved)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(header("bench_kernels"), flush=True)
    assert cpu_kv and cpu_routing                           # CPU path is what kernels.* dispatches to here
    memcpy = copy_gbps("cpu", args.repeats)
    print(f"CPU: {torch.get_num_threads()} threads, memcpy {memcpy:.2f} GB/s, rows {args.rows}")
    print(f"{'op':28s} {'impl ms':>9s} {'ref ms':>9s} {'speedup':>8s} {'GB/s':>7s} {'÷memcpy':>8s}")
    for name, moved, fn in cases(args.rows, "cpu"):
        t_impl = median_s(fn, args.repeats)
        t_ref = median_s(reference_fn(name, fn), max(3, args.repeats // 2))
        gbps = moved / t_impl / 1e9
        print(f"{name:28s} {t_impl * 1e3:9.3f} {t_ref * 1e3:9.3f} {t_ref / t_impl:7.1f}x {gbps:7.2f} {gbps / memcpy:8.2f}")
    if torch.cuda.is_available() and importable("cupy"):
        gpu_copy = copy_gbps("cuda", args.repeats)
        print(f"\nGPU: {torch.cuda.get_device_name()}, copy {gpu_copy:.1f} GB/s")
        print(f"{'op':28s} {'cuda ms':>9s} {'GB/s':>7s} {'÷copy':>8s}")
        for name, moved, fn in cases(args.rows * 8, "cuda"):
            t = median_s(fn, args.repeats, cuda=True)
            gbps = moved / t / 1e9
            print(f"{name:28s} {t * 1e3:9.3f} {gbps:7.1f} {gbps / gpu_copy:8.2f}")


if __name__ == "__main__":
    main()
