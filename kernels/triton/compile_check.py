"""Compile every fused decode kernel for real GPU targets without a GPU, through its own wrapper.

The interpreter accepts programs the compiler rejects (and never allocates registers), so this
runs each public wrapper on ``meta`` tensors of DeepSeek-V4 shapes with the JIT launch replaced
by ``triton.compile`` for sm_90 / sm_100a (TTIR → PTX → cubin with Triton's bundled ptxas), then
reports registers and spills from ``ptxas -v``. Run as ``python -m kernels.triton.compile_check
[--small] [--arch sm_90a]`` in a process without TRITON_INTERPRET (it refuses otherwise); exits non-zero on the
first failure. ``--small`` uses the unit tests' sizes (faster; what tests/kernels runs).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Triton 3.9 emits PTX 9.x, which only the bundled ptxas-blackwell reads (it assembles sm_90a too).
ARCHS = (("sm_90a", GPUTarget("cuda", 90, 32), "ptxas-blackwell"),
         ("sm_100a", GPUTarget("cuda", 100, 32), "ptxas-blackwell"))
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
           torch.int32: "i32", torch.int64: "i64"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _signature(fn, bound: dict) -> tuple[dict, dict]:
    sig, consts = {}, {}
    for p in fn.params:
        value = bound[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[p.name] = "*" + _DTYPES[value.dtype]
        elif isinstance(value, bool):
            sig[p.name] = "i1"
        elif isinstance(value, int):
            sig[p.name] = "i64" if abs(value) >= 2**31 else "i32"
        else:
            sig[p.name] = "fp32"
    return sig, consts


def _ptxas_usage(ptx: str, arch: str, tool: str) -> str:
    """'N regs, S B spill' from ptxas -v on the kernel's PTX."""
    binary = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run([str(binary), "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True)
    log = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return f"{regs.group(1) if regs else '?'} regs, {spills.group(1) if spills else '?'} B spill"


@contextmanager
def compiling(results: list[str], label: str, archs=ARCHS):
    """Replace JIT launches by compiles for every target; append one line per compiled kernel."""
    original = triton.runtime.jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
        bound = dict(zip(self.arg_names, args)) | kwargs
        sig, consts = _signature(self, bound)
        for arch, target, tool in archs:
            compiled = triton.compile(ASTSource(self, sig, consts), target=target, options=options)
            usage = _ptxas_usage(compiled.asm["ptx"], arch, tool)
            results.append(f"ok  {label:44s} {self.__name__:26s} {arch:8s} {usage}")

    triton.runtime.jit.JITFunction.run = run
    try:
        yield
    finally:
        triton.runtime.jit.JITFunction.run = original


def _meta(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _pool(fmt: str, dim: int, blocks: int, per_block: int) -> torch.Tensor:
    from kernels.formats import get_format
    from kernels.triton.kv_codec import RAW_DTYPES

    if fmt in RAW_DTYPES:
        return _meta(blocks, per_block, dim, dtype=RAW_DTYPES[fmt])
    return _meta(blocks, per_block, get_format(fmt, dim).record_bytes, dtype=torch.uint8)


def cases(small: bool):
    """(label, thunk) per kernel configuration; the thunk calls the public wrapper."""
    from kernels.triton.compressor_step import compressor_step
    from kernels.triton.indexer_topk import indexer_topk
    from kernels.triton.mhc_mix import mhc_mix
    from kernels.triton.sparse_mla_decode import sparse_mla_decode

    b, h, d, di, hi = (2, 3, 128, 64, 4) if small else (4, 64, 512, 128, 64)
    w, k, e_blocks, topk = (17, 17, 5, 16) if small else (127, 512, 128, 512)
    i32 = torch.int32
    out = []
    # On a GPU the attention wants bf16 operands at D = 512 (fp32 "ieee" dots spill); small: the tests' mode.
    precisions = ("ieee",) if small else ("bf16", "ieee")
    # q = 1 decode, then a verify step of 1 + 3 drafts (its tokens fold into the program's rows:
    # M = 64); the engine's tables: window shared, CSA top-k per row.
    for q in (1,) if small else (1, 4):
        for wf, ef in (("fp8_ds_mla", "fp4_kv"), ("fp8_ds_mla", "fp8_ds_mla"), ("bf16", "bf16")):
            for prec in precisions[: 1 if wf == "bf16" else 2]:
                out.append((f"sparse_mla_decode q={q} {wf}/{ef} D={d} {prec}",
                            lambda q=q, wf=wf, ef=ef, prec=prec: sparse_mla_decode(
                                _meta(b, q, h, d, dtype=torch.bfloat16), _meta(h), _pool(wf, d, 64, 256), wf,
                                _meta(b, q, w, dtype=i32), _pool(ef, d, 64, 64), ef, _meta(b, q, k, dtype=i32),
                                new_kv=_meta(b, q, d, dtype=torch.bfloat16), precision=prec, window_shared=True)))
    for q in (1,) if small else (1, 4):
        out.append((f"indexer_topk q={q} fp4_index dI={di} k={topk}", lambda q=q: indexer_topk(
            _meta(b, q, hi, di), _meta(b, q, hi), _pool("fp4_index", di, 64, 64), "fp4_index",
            _meta(b, e_blocks, dtype=i32), _meta(b, dtype=i32), _meta(b, q, dtype=i32), 4, topk)))
    for m, overlap, dim, fmt in ((4, True, d, "fp8_ds_mla"), (4, True, d, "fp4_kv"), (4, True, di, "fp4_index"),
                                 (8 if small else 128, False, d, "fp8_ds_mla")):
        width = (2 if overlap else 1) * dim
        span = (2 if overlap else 1) * m
        out.append((f"compressor_step m={m} d={dim} {fmt}", lambda m=m, overlap=overlap, dim=dim, fmt=fmt, width=width,
                    span=span: compressor_step(
            _meta(b, 1, 2 * width), _meta(64, 256, 2 * width), _meta(b, span, dtype=i32), _pool(fmt, dim, 64, 64),
            fmt, _meta(b, 1, dtype=i32), _meta(dim), 1e-6, _meta(b, 1, 32), _meta(b, 1, 32), m, overlap,
            torch.bfloat16)))
    n, hidden, tokens = (4, 64, 17) if small else (4, 4096, 64)
    out.append((f"mhc_mix n={n} D={hidden}", lambda: mhc_mix(
        _meta(tokens, n, hidden, dtype=torch.bfloat16), _meta((2 + n) * n, n * hidden), _meta((2 + n) * n), _meta(3),
        20, 1e-6, 1e-6, collapse=True)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the unit tests' sizes")
    parser.add_argument("--arch", choices=[a for a, _, _ in ARCHS], help="one target only (default: all)")
    args = parser.parse_args(argv)
    archs = [a for a in ARCHS if args.arch in (None, a[0])]
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the kernels must be JIT functions to compile", file=sys.stderr)
        return 2
    results: list[str] = []
    for label, thunk in cases(args.small):
        try:
            with compiling(results, label, archs):
                thunk()
        except Exception as exc:  # a compile error: report which kernel and why
            print("\n".join(results))
            print(f"FAIL {label}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    print("\n".join(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
