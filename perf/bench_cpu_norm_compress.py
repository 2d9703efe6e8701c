"""CPU decode-step norm_rope / compressor_step: numba kernels vs their torch references, one thread.

Shapes of the tiny DeepSeek-V4 decode step: norm_rope on the q_lora / kv rows ([T, 1, 256 | 512],
weighted norm, rope 64, a bf16 window-pool write), the query heads ([T, 16, 512], head norm, rope 64)
and the attention output (fp32 in, bf16 out, inverse rope); compressor_step at B = 1 / 16, q = 1 / 2,
ratio 4 with overlap (width 2·512) and ratio 128, raw bf16 projections with ape, both when the last
token of each sequence completes an entry and when none does (the common case). Medians of repeated calls.

    python perf/bench_cpu_norm_compress.py [--repeats N]
"""
from __future__ import annotations

import argparse

import torch

from kernels import cpu_norm_compress as numba_ops
from kernels.formats import get_format
from kernels.triton.compressor_step import compressor_step_reference
from kernels.triton.norm_rope import norm_rope_reference
from perf.machine import header, median_s, set_cpu_threads

BF16 = torch.bfloat16


def _rope(t: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = (torch.arange(t, dtype=torch.float32)[:, None] + 7) / 100.0 ** (torch.arange(half) / half)
    return freqs.cos(), freqs.sin()


def norm_rope_cases() -> list[tuple[str, dict]]:
    g = torch.Generator().manual_seed(0)
    cases = []
    for d in (256, 512):
        cos, sin = _rope(1, 32)
        pool = torch.zeros(64, 16, d, dtype=BF16)
        cases.append((f"[1, 1, {d}] norm 1 + rope + bf16 pool", dict(
            x=torch.randn(1, 1, d, generator=g).to(BF16), norm=1, weight=1 + 0.1 * torch.randn(d, generator=g),
            eps=1e-6, cos=cos, sin=sin, pool=pool, pool_fmt="bf16", slots=torch.tensor([37]))))
    for t in (1, 16):
        cos, sin = _rope(t, 32)
        cases.append((f"[{t}, 16, 512] norm 2 + rope", dict(
            x=torch.randn(t, 16, 512, generator=g).to(BF16), norm=2, eps=1e-6, cos=cos, sin=sin)))
        cases.append((f"[{t}, 16, 512] fp32 -> bf16, inverse rope", dict(
            x=torch.randn(t, 16, 512, generator=g), norm=0, cos=cos, sin=sin, inverse=True, dtype=BF16)))
    return cases


def compressor_case(b: int, q: int, ratio: int, overlap: bool, complete: bool, entry_fmt: str) -> dict:
    """Raw bf16 [C | Z] rows with ape; the step's last token completes an entry (``complete``) or
    no token does."""
    g = torch.Generator().manual_seed(1)
    dim, per_block = 512, 16
    width, span = (2 if overlap else 1) * dim, (2 if overlap else 1) * ratio
    start = torch.full((b,), 10 * ratio - q - (0 if complete else 1))
    positions = start[:, None] + torch.arange(q)                                        # [B, q]
    n_rows = b * (span - 1 + q)
    blocks = n_rows // per_block + 2
    row_slots = torch.randperm(blocks * per_block, generator=g)[:n_rows].view(b, span - 1 + q)
    completes = (positions + 1) % ratio == 0
    entry_slots = torch.where(completes, torch.arange(b * q).view(b, q) + 3, -1)
    entry_pool = (torch.zeros(b * q // 16 + 2, 16, dim, dtype=BF16) if entry_fmt == "bf16" else
                  torch.zeros(b * q // 16 + 2, 16, get_format(entry_fmt, dim).record_bytes, dtype=torch.uint8))
    freqs = ((positions // ratio) * ratio)[..., None].float() / 100.0 ** (torch.arange(32) / 32)
    return dict(rows=torch.randn(b, q, 2 * width, generator=g).to(BF16),
                state_pool=torch.randn(blocks, per_block, 2 * width, generator=g), row_slots=row_slots,
                entry_pool=entry_pool, entry_fmt=entry_fmt, entry_slots=entry_slots,
                norm_weight=1 + 0.1 * torch.randn(dim, generator=g), eps=1e-6, cos=freqs.cos(), sin=freqs.sin(),
                ratio=ratio, overlap=overlap, dtype=BF16, ape=torch.randn(ratio, width, generator=g),
                positions=positions)


def _row(name: str, ours: float, ref: float) -> None:
    print(f"{name:<52} {ours * 1e6:9.1f} {ref * 1e6:9.1f} {ref / ours:7.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    set_cpu_threads(1)
    print(header("numba norm_rope / compressor_step vs torch references, 1 thread"))
    print(f"{'op / shape':<52} {'numba µs':>9} {'ref µs':>9} {'ratio':>8}")
    for name, kw in norm_rope_cases():
        ours = median_s(lambda: numba_ops.norm_rope(**kw), args.repeats)
        ref = median_s(lambda: norm_rope_reference(**kw), args.repeats)
        _row("norm_rope " + name, ours, ref)
    for ratio, overlap in ((4, True), (128, False)):
        for b, q in ((1, 1), (1, 2), (16, 1), (16, 2)):
            for complete in (False, True):
                for fmt in ("bf16", "fp8_ds_mla") if complete else ("bf16",):
                    kw = compressor_case(b, q, ratio, overlap, complete, fmt)
                    repeats = max(10, args.repeats // (8 if ratio == 128 and b == 16 else 1))
                    ours = median_s(lambda: numba_ops.compressor_step(**kw), repeats)
                    ref = median_s(lambda: compressor_step_reference(**kw), repeats)
                    what = f"{'last completes, ' + fmt if complete else 'none complete'}"
                    _row(f"compressor m={ratio}{' CSA' if overlap else ''} B={b} q={q} {what}", ours, ref)


if __name__ == "__main__":
    main()
