"""The CPU kernels' vector width (kernels/cpu_target.py): 512-bit vectors on AVX-512 hosts unless
the operator chose numba's target, checked in the code numba generates."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernels import cpu_target


def test_wide_vectors_only_where_the_host_has_avx512f():
    assert cpu_target.wide_vector_features("+avx2,+fma,+avx512f,-amx-tile") == \
        "+avx2,+fma,+avx512f,-amx-tile,-prefer-256-bit"
    assert cpu_target.wide_vector_features("+avx2,+fma,-avx512f") is None
    assert cpu_target.wide_vector_features("+avx2,+fma,+avx512fp16x") is None        # a name, not the flag


# A child that configures like kernels/__init__.py, compiles one loop (no cache: the assembly is
# only inspectable for fresh code) and reports the widest vector registers it uses.
CHILD = """
import json, os, re, sys
import numpy as np
if sys.argv[1] == "numba-first":      # as in a worker, where engine/worker.py imports numba first
    import numba
from kernels import cpu_target
chosen = cpu_target.configure()
import numba

@numba.njit(fastmath=True)
def dot(a, b):
    s = np.float32(0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s

x = np.ones(4096, np.float32)
dot(x, x)
asm = dot.inspect_asm(dot.signatures[0])
print(json.dumps({"chosen": chosen, "env": os.environ.get("NUMBA_CPU_FEATURES"),
                  "zmm": bool(re.search(r"%zmm", asm)), "ymm": bool(re.search(r"%ymm", asm))}))
"""


def _child(env_extra: dict[str, str], order: str = "kernels-first") -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_FEATURES", "NUMBA_CPU_NAME")} | env_extra
    out = subprocess.run([sys.executable, "-c", CHILD, order], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _host_has_avx512f() -> bool:
    import llvmlite.binding as llvm

    return "+avx512f" in llvm.get_host_cpu_features().flatten().split(",")


@pytest.mark.parametrize("order", ["kernels-first", "numba-first"])
def test_the_kernels_compile_to_512_bit_vectors_on_an_avx512_host(order):
    got = _child({}, order)
    if not _host_has_avx512f():
        assert got["chosen"] is None and got["env"] is None and not got["zmm"]     # left as numba builds it
        pytest.skip("this CPU has no AVX-512F: nothing to widen (checked that nothing changed)")
    assert got["chosen"] == got["env"] and got["env"].endswith(",-prefer-256-bit")
    assert got["zmm"], "the loop was not vectorised with 512-bit registers"


def test_the_operators_numba_target_is_kept():
    named = _child({"NUMBA_CPU_NAME": "generic"})
    assert named["chosen"] is None and named["env"] is None
    if _host_has_avx512f():
        import llvmlite.binding as llvm

        host = llvm.get_host_cpu_features().flatten()
        own = _child({"NUMBA_CPU_FEATURES": host})                 # LLVM's own tuning: 256-bit vectors
        assert own["chosen"] is None and own["env"] == host and not own["zmm"] and own["ymm"]
