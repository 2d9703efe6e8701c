"""A worker keeps to its CPU thread budget (`--threads-per-worker`) in numba and torch alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server.worker_entry import transparent_huge_pages_mode

# The order server.worker_entry.main follows: pin, then import the engine's kernels (numba with
# them), then torch.set_num_threads as engine.worker_process does; then one parallel numba kernel
# (a small one of its own: compiling one of the engine's would take longer than the test).
CHILD = """
import json, sys
import numpy as np
from server.worker_entry import pin_cpu_threads
pin_cpu_threads(int(sys.argv[1]))
import torch, numba
import kernels.cpu_quant_gemm  # noqa: F401

@numba.njit(parallel=True)
def double(a):
    for i in numba.prange(a.shape[0]):
        a[i] *= 2.0

torch.set_num_threads(int(sys.argv[1]))
double(np.ones(1 << 16))  # starts numba's thread pool
print(json.dumps({"numba": numba.get_num_threads(), "torch": torch.get_num_threads()}))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every budget is the whole machine")
def test_a_one_thread_worker_stays_on_one_thread_after_numba_starts():
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", CHILD, "1"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"numba": 1, "torch": 1}


def test_pinning_after_numba_is_imported_is_refused():
    code = "import numba\nfrom server.worker_entry import pin_cpu_threads\npin_cpu_threads(1)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "before numba is imported" in out.stderr


@pytest.mark.parametrize("device, operator, expected", [("cpu", None, None), ("cpu", "PASSIVE", "PASSIVE"),
                                                       ("cuda", None, "PASSIVE"), ("cuda", "ACTIVE", "ACTIVE")])
def test_cpu_workers_keep_libgomps_spin_and_gpu_workers_sleep_unless_the_operator_says_otherwise(
        device, operator, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if operator is not None:
        env["OMP_WAIT_POLICY"] = operator
    code = ("import os\nfrom server.worker_entry import pin_cpu_threads\n"
            f"pin_cpu_threads(1, {device!r})\nprint(os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == str(expected), out.stderr[-2000:]


@pytest.mark.parametrize("device, before, after", [
    ("cpu", None, "glibc.malloc.hugetlb=1"),
    ("cpu", "glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ("cpu", "glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),              # the operator's setting wins
    ("cpu", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2"),
    ("cuda", None, None)])
def test_cpu_workers_start_with_huge_page_malloc_unless_the_operator_set_it(device, before, after):
    from server.worker_entry import worker_env

    base = {"PATH": "/usr/bin"} | ({"GLIBC_TUNABLES": before} if before is not None else {})
    env = worker_env(device, base)
    assert env.get("GLIBC_TUNABLES") == after and env["PATH"] == "/usr/bin"
    assert base.get("GLIBC_TUNABLES") == before                                 # the caller's dict is left alone


# A 64 MiB tensor (torch's CPU allocator asks glibc, which mmaps it; numpy would madvise huge
# pages itself), touched once: minor page faults counted by the kernel.
FAULTS = """
import resource, torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = torch.ones(16 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(transparent_huge_pages_mode() != "madvise", reason="the tunable only changes anything where THP is `madvise`")
def test_the_huge_page_tunable_cuts_a_workers_page_faults():
    """What the worker's environment does, seen by the kernel: a fresh 64 MiB block faults in
    16384 pages of 4 KiB without the tunable, far fewer (2 MiB pages) with it (glibc 2.35+)."""
    import platform

    from server.worker_entry import worker_env

    if tuple(int(x) for x in platform.libc_ver()[1].split(".")[:2] or (0, 0)) < (2, 35):
        pytest.skip(f"glibc {platform.libc_ver()[1]} predates glibc.malloc.hugetlb (2.35)")
    plain = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")}

    def faults(env: dict[str, str]) -> int:
        out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.strip().splitlines()[-1])

    small, huge = faults(plain), faults(worker_env("cpu", plain))
    assert small >= 16384 and huge < small // 8, (small, huge)
