"""Compile every kernels/cuda/*.cu for each target arch with NVRTC (and nvcc when on PATH).

Needs no GPU. Run as ``python -m kernels.compile_check [--usage]``; exits non-zero and prints
the compiler log on the first failure. ``--usage`` (needs nvcc) also prints each kernel's
registers and spill bytes per target from ``ptxas -v`` (`ptxas_usage`).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
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


def _instances_wrapper(path: Path) -> str:
    """nvcc compiles a template only where it is used, so a wrapper includes the file and takes the
    address of each registered instantiation (NAME_EXPRESSIONS): the same kernels NVRTC builds."""
    names = NAME_EXPRESSIONS.get(path.stem, ())
    refs = ", ".join(f"(const void*)&{name}" for name in names)
    return f'#include "{path.resolve()}"\n' + (f"const void* const ringserve_instances[] = {{{refs}}};\n" if names else "")


def _nvcc(path: Path, archs: tuple[str, ...], nvcc: str, kind: str, extra: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """(output, compiler log) of nvcc -``kind`` on `path`'s instances wrapper for `archs`."""
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / f"{path.stem}_all.cu", Path(tmp) / f"out.{kind}"
        src.write_text(_instances_wrapper(path))
        cmd = [nvcc, "-std=c++17", *gencode, *extra, f"-{kind}", "-o", str(out), str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise CompileError(f"{path.name} ({', '.join(archs)}, nvcc): {done.stdout}{done.stderr}")
        return out.read_bytes(), done.stdout + done.stderr


def nvcc_fatbin(path: Path, archs: tuple[str, ...], nvcc: str) -> bytes:
    """One fatbin of `path` for every arch in `archs`, built by nvcc with its toolkit's headers."""
    return _nvcc(path, archs, nvcc, "fatbin")[0]


@dataclass(frozen=True)
class KernelUsage:
    """One kernel's resources on one target, from ptxas -v."""

    file: str
    kernel: str          # demangled name with its template arguments
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_USED = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _demangle(names: list[str]) -> list[str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if not tool or not names:
        return names
    done = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    out = done.stdout.splitlines()
    return out if done.returncode == 0 and len(out) == len(names) else names


def parse_ptxas_log(file: str, log: str) -> list[KernelUsage]:
    """Per-entry usage from a ptxas -v log: an entry line, then its registers and its frame."""
    rows: list[tuple[str, str, int, int, int, int]] = []
    entry: tuple[str, str] | None = None
    regs = frame = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry, regs, frame = (m.group(1), m.group(2)), None, None
        elif entry and (m := _FRAME.search(line)):
            frame = tuple(int(g) for g in m.groups())
        elif entry and (m := _USED.search(line)):
            regs = int(m.group(1))
        if entry and regs is not None and frame is not None:
            rows.append((entry[0], entry[1], regs, frame[1], frame[2], frame[0]))
            entry = None
    names = [n.split("(", 1)[0].removeprefix("void ") for n in _demangle([r[0] for r in rows])]
    return [KernelUsage(file, name, arch, regs, stores, loads, stack)
            for name, (_, arch, regs, stores, loads, stack) in zip(names, rows)]


def ptxas_usage(path: Path, arch: str, nvcc: str) -> list[KernelUsage]:
    """Registers and spills of every kernel instance of `path` on `arch` (nvcc -Xptxas -v)."""
    _, log = _nvcc(path, (arch,), nvcc, "cubin", ("-Xptxas", "-v"))
    usage = parse_ptxas_log(path.name, log)
    if not usage:
        raise CompileError(f"{path.name} ({arch}): ptxas -v reported no kernel:\n{log}")
    return usage


def main(argv: list[str] | None = None) -> int:
    usage = "--usage" in (sys.argv[1:] if argv is None else argv)
    nvcc = shutil.which("nvcc")
    if usage and not nvcc:
        print("--usage needs nvcc on PATH", file=sys.stderr)
        return 2
    try:
        for path in cuda_sources():
            for arch in ARCHS:
                nvrtc_compile(path, arch)
                if nvcc:
                    nvcc_compile(path, arch, nvcc)
                print(f"ok  {path.name}  {arch}  nvrtc{' + nvcc' if nvcc else ''}")
                for k in ptxas_usage(path, arch, nvcc) if usage else []:
                    print(f"    {k.kernel:48s} {k.registers:3d} regs, {k.spill_stores} B spill stores, "
                          f"{k.spill_loads} B spill loads, {k.stack} B stack")
    except CompileError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
