"""How precisely a CPU worker multiplies fp32 matrices (`--cpu-matmul-precision`).

A CPU worker computes in fp32 (the compute dtype `auto`), and its big matrix products are torch's:
the sgemms of the FP8/FP4 tiled path (prefill, decode batches past the fused row kernels),
attention's einsums in prefill, the dense projections and the LM head. torch lets oneDNN run
an fp32 matmul with both operands rounded to bf16 and the products accumulated in fp32 into an
fp32 result, the role TF32 plays on GPUs. On a Xeon with AMX that runs prefill-sized GEMMs
3-3.5x faster, with the relative error of bf16 operands (~2.5e-3); norms, softmax, routing, the
residual stream and the KV records stay fp32, which keeps it closer to fp32 than `--dtype bf16`.

But oneDNN's bf16 path costs ~20 us a call whatever the size (it converts both operands), so a
small product is slower that way: 3 us -> 20 us for a 64x256 router at 16 rows, 0.31 -> 0.49 ms
for a batch-1 LM head. Only products of at least BF16_MIN_MACS multiply-adds take it; the call
sites ask `bf16_operands(m * k * n)`.

  fp32   exact fp32 products (what the parity tests compare against transformers)
  bf16   bf16 operands, fp32 accumulation, for products of BF16_MIN_MACS or more
  auto   bf16 on CPUs with bf16 arithmetic, AMX or AVX512-BF16 (where it was measured to pay),
         when the compute dtype is left at auto; fp32 when `--dtype fp32` was asked for (exact
         fp32 stays exact), for DeepSeek-V4.1 (whose numerics follow DeepSeek's reference GEMM
         by GEMM, engine/v41/numerics.py), and on CPUs without either (AVX2 has no bf16
         arithmetic). On an AMD EPYC (Zen 4: AVX512-BF16, no AMX) the products torch hands
         oneDNN under this setting came back exact fp32 (tests/kernels/test_cpu_precision.py
         probes which a CPU does), yet 1.06-1.38x faster than MKL's sgemm on prefill-sized
         shapes: the tiny V4's prefill took 0.89x / 0.95x the time at batch 1 / 16, its decode
         steps 0.97-0.98x (perf/bench_cpu_decode.py --variants bf16-mm). `--batch-invariant`
         refuses bf16: which path a product takes depends on the step's row count.

Per process: a worker calls `apply` once, for the CPU only (on a GPU the compute dtype is bf16
already, and its remaining fp32 matmuls, router and mHC, keep full precision). Outside a
`bf16_operands` block torch's setting stays at its default ('highest'); blocks do not nest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PRECISIONS = ("auto", "fp32", "bf16")  # engine.config.CPU_MATMUL_PRECISIONS
# Break-even on a 2-core Xeon (Sapphire Rapids, AMX), one thread: at 4.2 M multiply-adds bf16
# lost (2x256 @ 256x8192: 309 -> 441 us) or tied (8x2048 @ 2048x256), from 8.4 M on it won
# 1.3-1.7x (4x256 @ 256x8192, 16x2048 @ 2048x256), 3.4x on a 128-row prefill tile.
BF16_MIN_MACS = 1 << 23
BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})   # /proc/cpuinfo flags of bf16 arithmetic

_bf16_allowed = False


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve(precision: str, dtype: str = "auto", flags: set[str] | None = None, reference_numerics: bool = False) -> str:
    """'auto' -> 'bf16' on a CPU with AMX or AVX512-BF16, with the compute dtype left at auto
    and a model without reference numerics (V4.1), else 'fp32'; 'fp32' and 'bf16' stay as they are."""
    if precision not in PRECISIONS:
        raise ValueError(f"cpu matmul precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision
    bf16_arithmetic = bool(BF16_FLAGS & (cpu_flags() if flags is None else flags))
    return "bf16" if bf16_arithmetic and dtype == "auto" and not reference_numerics else "fp32"


def apply(precision: str, dtype: str = "auto", reference_numerics: bool = False) -> str:
    """Allow (or not) bf16 operands for this process's large fp32 matmuls; returns the resolution."""
    global _bf16_allowed
    resolved = resolve(precision, dtype, reference_numerics=reference_numerics)
    _bf16_allowed = resolved == "bf16"
    return resolved


def bf16_allowed() -> bool:
    return _bf16_allowed


class _Bf16Operands:
    """torch's fp32 matmuls take bf16 operands inside the block (a plain class: ~0.2 us a use)."""

    __slots__ = ()

    def __enter__(self) -> None:
        torch.set_float32_matmul_precision("medium")

    def __exit__(self, *exc) -> None:
        torch.set_float32_matmul_precision("highest")


_BF16 = _Bf16Operands()
_EXACT = contextlib.nullcontext()


def takes_bf16(macs: int) -> bool:
    """Whether a product of `macs` multiply-adds (M·K·N) gets bf16 operands in this process."""
    return _bf16_allowed and macs >= BF16_MIN_MACS


def bf16_operands(macs: int):
    """The block for one fp32 product of `macs` multiply-adds (M·K·N): bf16 operands where this
    process allows them and the product is large enough to gain, else a no-op."""
    return _BF16 if takes_bf16(macs) else _EXACT


@contextlib.contextmanager
def matmul_precision(precision: str, dtype: str = "auto") -> Iterator[str]:
    """apply(precision, dtype) for the duration of a block (benchmarks, tests), then restore."""
    global _bf16_allowed
    saved = _bf16_allowed
    try:
        yield apply(precision, dtype)
    finally:
        _bf16_allowed = saved
