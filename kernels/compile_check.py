"""Compile every kernels/cuda/*.cu for each target arch with NVRTC (and nvcc when on PATH).

Needs no GPU. Run as ``python -m kernels.compile_check``; exits non-zero and prints the
compiler log on the first failure.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kernels.cuda_names import NAME_EXPRESSIONS
from kernels.loader import compile_options, cuda_sources, source_text

ARCHS = ("sm_90", "sm_100a")


class CompileError(RuntimeError):
    """A .cu file failed to compile; the message holds the compiler log."""


def nvrtc_compile(path: Path, arch: str) -> str:
    """Compile ``path`` (all its registered template instantiations) to PTX; returns the log."""
    import cupy.cuda

    nvrtc = cupy.cuda.nvrtc
    prog = nvrtc.createProgram(source_text(path), str(path), [], [])
    try:
        for name in NAME_EXPRESSIONS.get(path.stem, ()):
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [*compile_options(), f"--gpu-architecture={arch}"])
        except nvrtc.NVRTCError as exc:
            raise CompileError(f"{path.name} ({arch}): {exc}\n{nvrtc.getProgramLog(prog)}") from exc
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def nvcc_compile(path: Path, arch: str, nvcc: str) -> None:
    """Device-only compile with the toolkit's own headers (checks non-template code)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-std=c++17", f"-arch={arch}", "-cubin", "-o", str(Path(tmp) / "out.cubin"), str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise CompileError(f"{path.name} ({arch}, nvcc): {done.stdout}{done.stderr}")


def main() -> int:
    nvcc = shutil.which("nvcc")
    try:
        for path in cuda_sources():
            for arch in ARCHS:
                nvrtc_compile(path, arch)
                if nvcc:
                    nvcc_compile(path, arch, nvcc)
                print(f"ok  {path.name}  {arch}  nvrtc{' + nvcc' if nvcc else ''}")
    except CompileError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
