"""Every fused decode kernel compiles to a cubin for sm_90a through its own wrapper (no GPU needed).

The interpreter tests check semantics; this checks that the real compiler accepts the same
programs (the interpreter is more permissive). It runs kernels.triton.compile_check at the unit
tests' sizes in a subprocess, because triton.jit picks interpreted or compiled at import time.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ("_sparse_mla_decode_kernel", "_scores_kernel", "_topk_kernel", "_compressor_step_kernel", "_mhc_mix_kernel")


@pytest.mark.slow
def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated (it warns when unset)
    done = subprocess.run([sys.executable, "-m", "kernels.triton.compile_check", "--small", "--arch", "sm_90a"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert all(line.startswith("ok") for line in lines)
    for kernel in KERNELS:
        assert any(kernel in line for line in lines), f"{kernel} was not compiled"
