"""Registers and spills of every Triton launch (and every CuPy .cu kernel) on sm_90a and sm_100a.

Compiles, without a GPU, the launches the built-in wrapper cases make at the tiny, small and
released geometries (kernels/triton/compile_cases.py) and/or launch-record JSON files a dry run
of the engine wrote (kernels/triton/launch_record.py), each distinct specialisation once per
target, in parallel processes. Prints one row per kernel × geometry × target: how many distinct
specialisations, the most registers, the most spill bytes (stores; the largest case named), and
how many spill at all; ``--detail`` prints every specialisation. ``--cuda`` adds ptxas -v for the
CuPy kernels (kernels/compile_check.py, needs nvcc). Exits 1 on any compile error (a kernel over
the shared-memory limit included), or a spill over ``--max-spill`` bytes.

    python perf/triton_compile_report.py --geometry released --jobs 16 --json released.json
    python perf/triton_compile_report.py --records dry_run_launches.json --arch sm_90a
Runs without TRITON_INTERPRET (it re-executes itself without it); Triton's cache keeps reruns fast.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernels.triton.compile_cases import GEOMETRIES  # noqa: E402
from kernels.triton.compile_check import ARCHS, CompileResult, compile_record, record_cases  # noqa: E402
from kernels.triton.launch_record import LaunchRecord, load_records, unique  # noqa: E402


def _geometry_of(labels: list[str]) -> str:
    """A launch's geometry: the first word of a built-in label, 'records' for a file's launches."""
    first = labels[0].split(" ", 1)[0]
    return first if first in GEOMETRIES else "records"


def _compile(job: tuple[LaunchRecord, str]) -> CompileResult:
    return compile_record(*job)


def compile_all(records: list[LaunchRecord], archs: list[str], jobs: int) -> list[tuple[CompileResult, list[str]]]:
    """Every distinct specialisation of ``records`` compiled for each of ``archs``."""
    distinct = unique(records)
    work = [(record, arch) for record, _ in distinct for arch in archs]
    labels = {record.spec_key(): names for record, names in distinct}
    results: list[CompileResult] = []

    def progress(result: CompileResult) -> None:
        results.append(result)
        if len(results) % 25 == 0 or len(results) == len(work):
            print(f"[{len(results)}/{len(work)} compiled]", file=sys.stderr, flush=True)

    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            for result in pool.map(_compile, work, chunksize=1):
                progress(result)
    else:
        for w in work:
            progress(_compile(w))
    return [(r, labels[r.record.spec_key()]) for r in results]


def summary_rows(results: list[tuple[CompileResult, list[str]]]) -> list[dict]:
    """One row per (kernel, geometry, arch): specialisations, max registers, max spill, failures."""
    groups: dict[tuple[str, str, str], list[tuple[CompileResult, list[str]]]] = defaultdict(list)
    for result, labels in results:
        groups[(result.record.name, _geometry_of(labels), result.arch)].append((result, labels))
    rows = []
    for (kernel, geometry, arch), items in sorted(groups.items(), key=lambda kv: (kv[0][0], GEOMETRIES.index(
            kv[0][1]) if kv[0][1] in GEOMETRIES else 9, kv[0][2])):
        ok = [(r, labels) for r, labels in items if r.ok]
        worst = max(ok, key=lambda x: (x[0].spill_stores, x[0].registers), default=None)
        rows.append({"kernel": kernel, "geometry": geometry, "arch": arch, "specialisations": len(items),
                     "failed": len(items) - len(ok), "max_registers": max((r.registers for r, _ in ok), default=-1),
                     "max_spill": worst[0].spill_stores if worst else -1,
                     "spilling": sum(r.spill_stores > 0 for r, _ in ok),
                     "max_shared": max((r.shared for r, _ in ok), default=-1),
                     "worst": worst[1][0] if worst and worst[0].spill_stores else ""})
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'kernel':26s} {'geometry':9s} {'target':8s} {'specs':>5s} {'regs':>5s} {'spill B':>8s} " \
           f"{'spilling':>8s} {'smem B':>7s}  worst case"
    print(head)
    print("-" * len(head))
    for r in rows:
        failed = f"  ({r['failed']} FAILED)" if r["failed"] else ""
        print(f"{r['kernel']:26s} {r['geometry']:9s} {r['arch']:8s} {r['specialisations']:5d} {r['max_registers']:5d} "
              f"{r['max_spill']:8d} {r['spilling']:8d} {r['max_shared']:7d}  {r['worst']}{failed}")


def cuda_usage() -> list[dict]:
    """ptxas -v of every kernels/cuda/*.cu instance per target (nvcc's own ptxas)."""
    import shutil

    from kernels.compile_check import ARCHS as CUDA_ARCHS
    from kernels.compile_check import ptxas_usage
    from kernels.loader import cuda_sources

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("--cuda needs nvcc on PATH")
    return [vars(k) for path in cuda_sources() for arch in CUDA_ARCHS for k in ptxas_usage(path, arch, nvcc)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", action="append", choices=GEOMETRIES,
                        help="built-in cases (repeatable; default: all three unless --records)")
    parser.add_argument("--quick", action="store_true", help="one verify step per geometry")
    parser.add_argument("--records", action="append", default=[], help="a JSON file of launch records")
    parser.add_argument("--arch", action="append", choices=list(ARCHS), help="targets (default: all)")
    parser.add_argument("--kernel", help="only kernels whose name contains this")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-spill", type=int, help="fail when any specialisation spills more bytes")
    parser.add_argument("--detail", action="store_true", help="every specialisation, not only the summary")
    parser.add_argument("--cuda", action="store_true", help="also ptxas -v of the CuPy .cu kernels")
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels must be JIT functions: start over without it
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)], env)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (it warns when unset)
    records = [r for path in args.records for r in load_records(path)]
    for geometry in args.geometry or ([] if args.records else list(GEOMETRIES)):
        records += record_cases(geometry, args.quick)
    if args.kernel:
        records = [r for r in records if args.kernel in r.name]
    results = compile_all(records, args.arch or list(ARCHS), max(1, args.jobs))
    if args.detail:
        for result, labels in results:
            print(result.line(labels[0] + (f" (+{len(labels) - 1})" if len(labels) > 1 else "")))
        print()
    rows = summary_rows(results)
    print_table(rows)
    cuda = cuda_usage() if args.cuda else []
    if cuda:
        print(f"\n{'file':16s} {'kernel':40s} {'target':8s} {'regs':>5s} {'spill B':>8s} {'stack B':>8s}")
        for k in cuda:
            print(f"{k['file']:16s} {k['kernel']:40s} {k['arch']:8s} {k['registers']:5d} {k['spill_stores']:8d} "
                  f"{k['stack']:8d}")
    failures = [(r, labels) for r, labels in results if not r.ok]
    over = [(r, labels) for r, labels in results
            if r.ok and args.max_spill is not None and r.spill_stores > args.max_spill]
    for r, labels in failures + over:
        print(r.line(labels[0]) + ("" if not r.ok else f"  (over --max-spill {args.max_spill})"), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({
            "summary": rows, "cuda": cuda,
            "launches": [{**r.record.to_json(), "arch": r.arch, "registers": r.registers,
                          "spill_stores": r.spill_stores, "spill_loads": r.spill_loads, "shared": r.shared,
                          "error": r.error, "labels": labels} for r, labels in results]}, indent=1) + "\n")
    print(f"\n{len(results)} compiles ({len(unique(records))} specialisations x {len(args.arch or ARCHS)} targets), "
          f"{len(failures)} failed, {len(over)} over the spill limit", file=sys.stderr)
    return 1 if failures or over else 0


if __name__ == "__main__":
    sys.exit(main())
