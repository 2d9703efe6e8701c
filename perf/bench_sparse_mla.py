"""Sparse-MLA decode attention: shared window tables (one read per sequence) vs per-token reads,
and the output-column split (programs per head block) side by side.

The verify step's q tokens of a sequence share one program of kernels/triton/sparse_mla_decode.py.
With `window_shared` (what engine/v4/fused_decode.py passes) the window's records are read once per
(sequence, head block); without it the same tables are read row by row, as per-token programs
did. Both run here side by side on the same pools and tables, at V4-Flash's attention shape
(64 heads × 512, window 128, CSA top-512 per token, fp8_ds_mla window / fp4_kv entries, bf16
dots), for q = 1 (decode) and verify steps of q = 2 and 4: median kernel time over --iters CUDA
event pairs, the ratio per-row / shared, and the KV bytes each reads (union vs per row).
Then the shared launch with each --parts (D split into that many column parts, one program
each: every part computes the block's scores again, and holds a smaller accumulator) against
the default `value_block` split: median times and ratios, the outputs checked equal to 1e-4 of
their scale (the same score chunks; a part's dot tile is narrower, its sums the same terms).
Without CUDA it runs the Triton interpreter at tiny sizes (a smoke run: its times mean nothing).

    python perf/bench_sparse_mla.py [--batch 32] [--q 1 2 4] [--iters 50] [--parts 1 2 4]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import reference  # noqa: E402
from kernels.formats import get_format  # noqa: E402
from kernels.triton.sparse_mla_decode import program_shape, sparse_mla_decode, value_block  # noqa: E402
from perf.machine import header, median_s  # noqa: E402

PER_BLOCK = 64  # records per pool block


def _pool(fmt: str, records: int, dim: int, device) -> torch.Tensor:
    """Records of random values, quantized on the host by the reference codec, then moved."""
    blocks = -(-records // PER_BLOCK) + 1
    pool = torch.zeros(blocks, PER_BLOCK, get_format(fmt, dim).record_bytes, dtype=torch.uint8)
    reference.quantize_scatter(torch.randn(blocks * PER_BLOCK, dim), pool, torch.arange(blocks * PER_BLOCK), fmt)
    return pool.to(device)


def case(b: int, q: int, h: int, d: int, w: int, k: int, entries: int, device):
    """StepMeta's layout: each sequence's window positions in its own slots, token t seeing the
    columns ≥ t; per-token top-k picks among the sequence's entries."""
    g = torch.Generator(device="cpu").manual_seed(q)
    cols = torch.arange(w)
    window = (torch.arange(b)[:, None] * w + cols)[:, None, :].expand(b, q, w) + PER_BLOCK  # block 0 unused
    window = torch.where(cols >= torch.arange(q)[:, None], window, -1)
    picks = torch.stack([torch.randperm(entries, generator=g)[:k] for _ in range(b * q)]).view(b, q, k)
    entry_slots = picks + (torch.arange(b) * entries)[:, None, None] + PER_BLOCK
    return dict(q=torch.randn(b, q, h, d, generator=g).to(device, torch.bfloat16),
                sink=torch.randn(h, generator=g).to(device),
                window_pool=_pool("fp8_ds_mla", b * w + PER_BLOCK, d, device), window_fmt="fp8_ds_mla",
                window_slots=window.int().to(device),
                entry_pool=_pool("fp4_kv", b * entries + PER_BLOCK, d, device), entry_fmt="fp4_kv",
                entry_slots=entry_slots.int().to(device),
                new_kv=torch.randn(b, q, d, generator=g).to(device, torch.bfloat16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--q", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--parts", type=int, nargs="*", default=[1, 2, 4], help="column parts to compare")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    print(header("bench_sparse_mla"), flush=True)
    if cuda:
        b, h, d, w, k, entries, iters, precision = args.batch, 64, 512, 127, 512, 2048, args.iters, "bf16"
        print(f"# {torch.cuda.get_device_name()}; B={b}, H={h}, D={d}, window {w}, top-{k} of {entries} entries")
    else:
        b, h, d, w, k, entries, iters, precision = 2, 4, 128, 17, 8, 32, 1, "ieee"
        print("# no CUDA: Triton interpreter at tiny sizes, a smoke run (times mean nothing)")
    print(f"{'q':>3s} {'M rows':>6s} {'per-row us':>11s} {'shared us':>10s} {'per-row/shared':>15s} "
          f"{'KV MB per-row':>14s} {'KV MB shared':>13s} {'same':>5s}")
    splits = {}
    for q in args.q:
        c = case(b, q, h, d, w, k, entries, device)
        rec_w = c["window_pool"].shape[-1]
        rec_e = c["entry_pool"].shape[-1]
        heads = -(-h // program_shape(q)[1])
        valid_w = int((c["window_slots"] >= 0).sum())
        union_w = int((c["window_slots"] >= 0).any(dim=1).sum())
        entries_read = int((c["entry_slots"] >= 0).sum()) * rec_e
        per_row_mb = heads * (valid_w * rec_w + entries_read) / 1e6
        shared_mb = heads * (union_w * rec_w + entries_read) / 1e6
        out = {}

        def run(shared: bool):
            out[shared] = sparse_mla_decode(**c, precision=precision, window_shared=shared)

        t_row = median_s(lambda: run(False), iters, cuda)
        t_shared = median_s(lambda: run(True), iters, cuda)
        same = torch.equal(out[False], out[True])
        q_pad, block_h = program_shape(q)
        print(f"{q:3d} {q_pad * block_h:6d} {t_row * 1e6:11.1f} {t_shared * 1e6:10.1f} {t_row / t_shared:14.2f}x "
              f"{per_row_mb:14.2f} {shared_mb:13.2f} {'yes' if same else 'NO':>5s}", flush=True)
        if not same:
            sys.exit("bench_sparse_mla: shared and per-row reads differ")
        splits[q] = (c, t_shared, out[True])
    default = {q: d // value_block(d, program_shape(q)[0] * program_shape(q)[1]) for q in args.q}
    print(f"\n{'q':>3s} {'parts':>5s} {'BLOCK_DV':>8s} {'us':>10s} {'vs default':>11s} {'max |diff|':>11s}")
    for q, (c, t_default, ref) in splits.items():
        print(f"{q:3d} {default[q]:5d} {d // default[q]:8d} {t_default * 1e6:10.1f} {'(default)':>11s}")
        for parts in args.parts:
            if parts == default[q] or d % parts or d // parts < 16:
                continue
            got = {}

            def run_parts(parts=parts):
                got[0] = sparse_mla_decode(**c, precision=precision, window_shared=True, block_dv=d // parts)

            t = median_s(run_parts, iters, cuda)
            diff = (got[0] - ref).abs().max().item()
            print(f"{q:3d} {parts:5d} {d // parts:8d} {t * 1e6:10.1f} {t / t_default:10.2f}x {diff:11.2e}", flush=True)
            if not diff <= 1e-4 * max(1.0, ref.abs().max().item()):
                sys.exit(f"bench_sparse_mla: {parts} column parts change the output by {diff}")


if __name__ == "__main__":
    main()
