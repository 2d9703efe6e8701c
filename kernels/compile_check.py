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

TARGETS = ("sm_90", "sm_100a", "sm_103a")  # H100/H200, B200, B300


def supported_archs() -> tuple[str, ...]:
    """The targets this NVRTC can build (sm_103 needs CUDA 12.9+); all of them on CUDA 13."""
    try:
        import cupy.cuda

        have = {f"sm_{a}" for a in cupy.cuda.nvrtc.getSupportedArchs()}
    except Exception:  # noqa: BLE001 - an NVRTC without the query: assume every target
        return TARGETS
    return tuple(t for t in TARGETS if t.rstrip("a") in have)


ARCHS = supported_archs()


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
    """Device-only compile with the toolkit's own headers, every instantiation included."""
    nvcc_fatbin(path, (arch,), nvcc)


def nvcc_fatbin(path: Path, archs: tuple[str, ...], nvcc: str) -> bytes:
    """One fatbin of `path` for every arch in `archs`, built by nvcc with its toolkit's headers.

    nvcc compiles a template only where it is used, so a wrapper includes the file and takes the
    address of each registered instantiation (NAME_EXPRESSIONS): the same kernels NVRTC builds."""
    names = NAME_EXPRESSIONS.get(path.stem, ())
    refs = ", ".join(f"(const void*)&{name}" for name in names)
    wrapper = f'#include "{path}"\n' + (f"const void* const ringserve_instances[] = {{{refs}}};\n" if names else "")
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / f"{path.stem}_all.cu", Path(tmp) / "out.fatbin"
        src.write_text(wrapper)
        cmd = [nvcc, "-std=c++17", *gencode, "-fatbin", "-o", str(out), str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise CompileError(f"{path.name} ({', '.join(archs)}, nvcc): {done.stdout}{done.stderr}")
        return out.read_bytes()


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
