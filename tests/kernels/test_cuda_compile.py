"""Every kernels/cuda/*.cu compiles with NVRTC for sm_90, sm_100a and sm_103a, and with the CUDA 13
nvcc (when on PATH) into one fatbin for all three, every instantiation included (no GPU needed)."""
from __future__ import annotations

import pytest

pytest.importorskip("cupy")

import shutil  # noqa: E402

from kernels.compile_check import (ARCHS, TARGETS, CompileError, nvcc_fatbin, nvrtc_compile,  # noqa: E402
                                   parse_ptxas_log, ptxas_usage)
from kernels.loader import cuda_include_dirs, cuda_sources  # noqa: E402


def test_headers_found():
    assert cuda_include_dirs(), "nvidia-cuda-runtime-cu12 include dir (cuda_fp4.h) not found"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", cuda_sources(), ids=lambda p: p.name)
def test_compiles(path, arch):
    nvrtc_compile(path, arch)       # raises CompileError carrying the compiler log


def test_errors_carry_the_log_and_real_line(tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text("#include <cuda_fp8.h>\n\n__global__ void k(int* p) { p[0] = undefined_name; }\n")
    with pytest.raises(CompileError, match=r'broken\.cu\(3\).*undefined_name'):
        nvrtc_compile(bad, "sm_90")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
@pytest.mark.parametrize("path", cuda_sources(), ids=lambda p: p.name)
def test_nvcc_builds_every_target(path):
    """The GPU image's toolchain (CUDA 13) builds H200 (sm_90), B200 (sm_100a) and B300 (sm_103a)."""
    fatbin = nvcc_fatbin(path, TARGETS, shutil.which("nvcc"))
    assert len(fatbin) > 1000
    for arch in ("sm_90", "sm_100a", "sm_103a"):
        assert arch.encode() in fatbin or arch.rstrip("a").encode() in fatbin, arch


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
@pytest.mark.parametrize("path", cuda_sources(), ids=lambda p: p.name)
def test_ptxas_reports_every_instance(path):
    """ptxas -v (nvcc -Xptxas -v) gives registers and spills for each registered instantiation on
    each target: every kernel the engine can launch, none spilling."""
    from kernels.cuda_names import NAME_EXPRESSIONS

    for arch in ("sm_90", "sm_100a"):
        usage = ptxas_usage(path, arch, shutil.which("nvcc"))
        assert {u.arch for u in usage} == {arch}
        names = {u.kernel.replace(" ", "") for u in usage}
        assert {n.replace(" ", "") for n in NAME_EXPRESSIONS.get(path.stem, ())} <= names
        assert all(0 < u.registers <= 255 and u.spill_stores == 0 for u in usage), usage


def test_ptxas_log_parsing():
    """The ptxas -v lines nvcc prints, per entry: its name, registers and frame (spills)."""
    log = ("ptxas info    : Compiling entry function '_Z10route_hashPKf' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z10route_hashPKf\n"
           "    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 0 barriers, 400 bytes cmem[0]\n")
    (u,) = parse_ptxas_log("moe_routing.cu", log)
    assert (u.kernel, u.arch, u.registers, u.spill_stores, u.spill_loads, u.stack) == (
        "route_hash", "sm_90", 40, 8, 12, 16)
