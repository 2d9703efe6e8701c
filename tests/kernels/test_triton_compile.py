"""Every Triton kernel compiles to a cubin for sm_90a from its recorded launches (no GPU needed).

The interpreter tests check semantics; this checks that the real compiler accepts the programs
the engine launches (the interpreter is more permissive) and that the launch recorder specialises
arguments as Triton's JIT does. The compiles run kernels.triton.compile_check in a subprocess
without TRITON_INTERPRET, because triton.jit picks interpreted or compiled at import time; the
recorder itself also works on this process's interpreted kernels (as the fake device's dry runs use it).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernels.triton.launch_record import LaunchRecord, load_records, recording, save_records, unique

ROOT = Path(__file__).resolve().parents[2]
KERNEL_DEF = re.compile(r"@triton\.jit\s*\ndef (_\w+_kernel)\(")


def _compile_env(extra_path: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated (it warns when unset)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _compile_check(*args: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kernels.triton.compile_check", *args], cwd=ROOT,
                          env=_compile_env(extra_path), capture_output=True, text=True, timeout=900)


def every_kernel() -> set[str]:
    """Each `@triton.jit def _..._kernel(` in kernels/triton/ (helpers are not launched)."""
    return {name for path in (ROOT / "kernels" / "triton").glob("*.py") for name in KERNEL_DEF.findall(path.read_text())}


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper():
    done = _compile_check("--geometry", "tiny", "--quick", "--arch", "sm_90a")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines and all(line.startswith("ok") for line in lines), done.stdout
    compiled = {re.search(r" (_\w+_kernel) +sm_90a ", line).group(1) for line in lines}
    missing = every_kernel() - compiled
    assert not missing, f"kernels with no compile case (kernels/triton/compile_cases.py): {sorted(missing)}"
    for line in lines:
        regs = int(re.search(r"(\d+) regs", line).group(1))
        assert 0 < regs <= 255, line


_BROKEN = '''
import triton
import triton.language as tl


@triton.jit
def _broken_kernel(x_ptr, n, N: tl.constexpr):
    offs = tl.arange(0, N)          # N = 3: tl.arange needs a power of two
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)
'''


@pytest.mark.slow
def test_a_compile_error_is_a_failure(tmp_path):
    """A launch the compiler rejects fails the check (exit 1, a FAIL line naming the kernel),
    while the well-formed record beside it still compiles."""
    (tmp_path / "broken_kernels.py").write_text(_BROKEN)
    script = ("import torch, sys\nfrom broken_kernels import _broken_kernel\n"
              "from kernels.triton.launch_record import recording, save_records\n"
              "with recording(label='bad') as rec:\n"
              "    x = torch.empty(8, device='meta')\n"
              "    _broken_kernel[(1,)](x, 8, N=3)\n"
              "    rec.label = 'good'\n"
              "    _broken_kernel[(1,)](x, 8, N=8)\n"
              "save_records(sys.argv[1], rec.records)\n")
    records = tmp_path / "launches.json"
    made = subprocess.run([sys.executable, "-c", script, str(records)], cwd=ROOT, env=_compile_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert [r.label for r in load_records(records)] == ["bad", "good"]
    done = _compile_check("--records", str(records), "--arch", "sm_90a", extra_path=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    fail = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    ok = [line for line in done.stdout.splitlines() if line.startswith("ok")]
    assert len(fail) == 1 and "bad" in fail[0] and "_broken_kernel" in fail[0], done.stdout
    assert len(ok) == 1 and "good" in ok[0], done.stdout


def test_records_specialise_as_the_jit_does():
    """Pointer types for the engine's dtypes, 16-divisibility of addresses and ints, ints equal to 1
    as constexprs, bools and floats unspecialised: Triton's JIT rules (runtime/jit.py), read off
    meta tensors (no data)."""
    from kernels.triton.moe_ops import _gather_rows_kernel

    cases = {torch.int8: "*i8", torch.int16: "*i16", torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64",
             torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5", torch.bfloat16: "*bf16",
             torch.float16: "*fp16", torch.float32: "*fp32", torch.bool: "*u1"}
    with recording() as rec:
        for dtype in cases:
            x = torch.empty(64, 48, dtype=dtype, device="meta")
            _gather_rows_kernel[(2, 1)](x, torch.empty(4, dtype=torch.int32, device="meta"), x[:, 1:], 1, 48,
                                        BLOCK=64, num_warps=2)
    for dtype, record in zip(cases, rec.records):
        assert record.kernel == "kernels.triton.moe_ops:_gather_rows_kernel"
        assert record.signature["x_ptr"] == record.signature["out_ptr"] == cases[dtype]
        assert "x_ptr" in record.attrs and "out_ptr" not in record.attrs  # x[:, 1:] starts 1 element in
        assert record.signature["K"] == "constexpr" and record.constexprs["K"] == 1  # an int equal to 1
        assert record.signature["H"] == "i32" and record.attrs["H"] == "D"  # 48 = 3·16
        assert record.options == {"num_warps": 2} and record.grid == (2, 1)
    wide = LaunchRecord.from_json(json.loads(json.dumps(rec.records[0].to_json())))
    assert wide == rec.records[0] and len(unique(rec.records * 2)) == len(cases)
    with recording(), pytest.raises(TypeError, match="argument K: Triton cannot launch a int64"):
        x = torch.empty(64, 48, device="meta")  # a numpy scalar: a real launch rejects it too
        _gather_rows_kernel[(2, 1)](x, torch.empty(4, dtype=torch.int32, device="meta"), x, np.int64(2), 48, BLOCK=64)


def test_a_hook_sees_each_launch_and_can_refuse_it(tmp_path):
    """on_launch gets the kernel, its arguments by name and the grid, first; raising refuses the
    launch (the fake device's argument checks); records round-trip through JSON."""
    from kernels.triton.moe_ops import swiglu

    seen = []

    def hook(kernel, args, grid, record):
        seen.append((kernel.__name__, args["h_ptr"].shape, grid))
        if args["h_ptr"].dtype == torch.float16:
            raise TypeError("fp16 refused")

    with recording(label="swiglu", on_launch=hook) as rec:
        swiglu(torch.empty(5, 64, dtype=torch.bfloat16, device="meta"), 10.0)
        with pytest.raises(TypeError, match="fp16 refused"):
            swiglu(torch.empty(5, 64, dtype=torch.float16, device="meta"), 10.0)
    assert seen == [("_swiglu_kernel", (5, 64), (5, 1))] * 2
    assert len(rec.records) == 1 and rec.records[0].signature["limit"] == "fp32"
    assert rec.records[0].signature["HAS_W"] == "constexpr" and rec.records[0].constexprs["BF16"] is True
    save_records(tmp_path / "l.json", rec.records)
    assert load_records(tmp_path / "l.json") == rec.records


def test_fake_cuda_tensors_are_recorded_without_data():
    """Under FakeTensorMode a `cuda` tensor has no storage: dtype, device and offset are enough."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kernels.triton.moe_ops import gather_rows

    with FakeTensorMode(), recording() as rec:
        gather_rows(torch.empty(8, 64, dtype=torch.bfloat16, device="cuda"),
                    torch.empty(16, dtype=torch.int32, device="cuda"), 2)
    (record,) = rec.records
    assert record.signature["x_ptr"] == "*bf16" and record.signature["order_ptr"] == "*i32"
    assert record.grid == (16, 1) and record.constexprs == {"BLOCK": 64}


@triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=2), triton.Config({"BLOCK": 64}, num_warps=4)],
                 key=["n"])
@triton.jit
def _tuned_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def test_an_autotuned_kernel_records_every_config():
    """Nothing is benchmarked (no device): each config is a launch to compile."""
    x = torch.empty(100, dtype=torch.float16, device="meta")
    with recording() as rec:
        _tuned_copy_kernel[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](x, x, 100)
    assert [(r.constexprs["BLOCK"], r.options["num_warps"], r.grid) for r in rec.records] == [(16, 2, (7,)),
                                                                                           (64, 4, (2,))]
    assert rec.records[0].kernel.endswith(":_tuned_copy_kernel") and rec.records[0].signature["src_ptr"] == "*fp16"
