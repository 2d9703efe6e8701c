"""Every kernels/cuda/*.cu compiles with NVRTC for sm_90, sm_100a and sm_103a, and with the CUDA 13
nvcc (when on PATH) into one fatbin for all three, every instantiation included (no GPU needed)."""
from __future__ import annotations

import pytest

pytest.importorskip("cupy")

import shutil  # noqa: E402

from kernels.compile_check import ARCHS, TARGETS, CompileError, nvcc_fatbin, nvrtc_compile  # noqa: E402
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
