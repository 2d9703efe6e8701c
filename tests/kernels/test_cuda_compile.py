"""Every kernels/cuda/*.cu compiles with NVRTC for sm_90 and sm_100a (no GPU needed)."""
from __future__ import annotations

import pytest

pytest.importorskip("cupy")

from kernels.compile_check import ARCHS, CompileError, nvrtc_compile  # noqa: E402
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
