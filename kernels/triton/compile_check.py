"""Compile recorded Triton launches for the real GPU targets without a GPU; registers and spills.

The interpreter accepts programs the compiler rejects (and never allocates registers), so each
`LaunchRecord` (kernels/triton/launch_record.py) is compiled here with `triton.compile` for
sm_90a (H100/H200) and sm_100a (B200): TTIR → PTX → cubin with Triton's bundled ptxas. The PTX is
then assembled once more by the same ptxas with the same flags plus ``-v`` for its registers and
spill bytes, and the shared memory the kernel asks for is checked against the target's limit (a
kernel over it compiles but cannot launch).

``python -m kernels.triton.compile_check [--geometry tiny] [--arch sm_90a] [--records FILE]``
compiles the built-in wrapper cases (kernels/triton/compile_cases.py) of a geometry and/or a JSON
file of records, one line per distinct specialisation and target, and exits 1 on any failure.
It must run without TRITON_INTERPRET (the kernels must be JIT functions); perf/triton_compile_report.py
is the full table.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kernels.triton.launch_record import LaunchRecord, load_records, recording, unique

# (arch, compute capability). Triton names the target sm_90a / sm_100a itself (wgmma, tcgen05).
ARCHS = {"sm_90a": 90, "sm_100a": 100}
SHARED_LIMIT = 232448          # bytes of shared memory one block may use on sm_90 and sm_100 (227 KiB)
_PTXAS_LINE = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class CompileResult:
    """One record compiled for one target; ``error`` is None when it compiled and fits."""

    record: LaunchRecord
    arch: str
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    shared: int = -1
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def line(self, labels: str = "") -> str:
        where = labels or self.record.label
        if not self.ok:
            return f"FAIL {where:52s} {self.record.name:26s} {self.arch:8s} {self.error}"
        return (f"ok   {where:52s} {self.record.name:26s} {self.arch:8s} {self.registers} regs, "
                f"{self.spill_stores} B spill, {self.shared} B smem")


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def ptxas_usage(ptx: str, capability: int, fp_fusion: bool = True) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ptxas -v, run with Triton's own flags
    (backends/nvidia/compiler.py make_cubin), so the allocation is the one Triton's cubin has."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(capability).path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(capability)}", str(src),
               "-o", str(Path(tmp) / "k.o")]
        done = subprocess.run(cmd, capture_output=True, text=True)
    log = done.stdout + done.stderr
    regs, spills = _PTXAS_LINE.search(log), _SPILLS.search(log)
    if done.returncode or not regs or not spills:
        raise RuntimeError(f"ptxas -v failed ({done.returncode}): {log[-2000:]}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def compile_record(record: LaunchRecord, arch: str) -> CompileResult:
    """Compile ``record`` for ``arch``; a compile error or an over-limit kernel becomes ``error``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    capability = ARCHS[arch]
    try:
        fn = record.jit_function()
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, a in record.attrs.items()
                 if a == "D"}
        src = ASTSource(fn, dict(record.signature), dict(record.constexprs), attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(record.options))
        fp_fusion = getattr(compiled.metadata, "enable_fp_fusion", True)
        regs, stores, loads = ptxas_usage(compiled.asm["ptx"], capability, bool(fp_fusion))
    except Exception as exc:  # noqa: BLE001 - every compiler failure is a reported result
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        return CompileResult(record, arch, error=message[:600])
    shared = int(compiled.metadata.shared)
    error = f"needs {shared} B of shared memory, over the {SHARED_LIMIT} B limit" if shared > SHARED_LIMIT else None
    return CompileResult(record, arch, regs, stores, loads, shared, error)


def record_cases(geometry: str, quick: bool = False) -> list[LaunchRecord]:
    """The launches the built-in wrapper cases of ``geometry`` make (kernels/triton/compile_cases.py)."""
    from kernels.triton.compile_cases import cases

    with recording() as rec:
        for label, thunk in cases(geometry, quick):
            rec.label = label
            thunk()
    return rec.records


def main(argv: list[str] | None = None) -> int:
    from kernels.triton.compile_cases import GEOMETRIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", action="append", choices=GEOMETRIES,
                        help="built-in cases of this geometry (repeatable; default: tiny unless --records)")
    parser.add_argument("--records", action="append", default=[], help="a JSON file of launch records")
    parser.add_argument("--arch", choices=list(ARCHS), help="one target only (default: all)")
    parser.add_argument("--quick", action="store_true", help="one verify step per geometry (the CI test's set)")
    parser.add_argument("--kernel", help="only kernels whose name contains this")
    args = parser.parse_args(argv)
    if interpreter_on():
        print("unset TRITON_INTERPRET: the kernels must be JIT functions to compile", file=sys.stderr)
        return 2
    records = [r for path in args.records for r in load_records(path)]
    for geometry in args.geometry or ([] if args.records else ["tiny"]):
        records += record_cases(geometry, args.quick)
    failed = 0
    for record, labels in unique(records):
        if args.kernel and args.kernel not in record.name:
            continue
        for arch in [a for a in ARCHS if args.arch in (None, a)]:
            result = compile_record(record, arch)
            failed += not result.ok
            print(result.line(labels[0] + (f" (+{len(labels) - 1})" if len(labels) > 1 else "")), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
