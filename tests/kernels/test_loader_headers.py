"""The kernel loader picks the CUDA headers whose major version is NVRTC's (NVRTC 12.9 fails on
CUDA 13's cuda_fp8.hpp, and the GPU image's NVRTC 13 wants CUDA 13 headers)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kernels import loader


def _headers(root: Path, version: int | None, fp4: bool = True) -> Path:
    root.mkdir(parents=True)
    if fp4:
        (root / "cuda_fp4.h").write_text("// fp4\n")
    if version is not None:
        (root / "cuda_runtime_api.h").write_text(f"#pragma once\n#define CUDART_VERSION  {version}\n")
    return root


@pytest.mark.parametrize("nvrtc,want", [(12, "cu12"), (13, "cu13"), (None, "cu13")])
def test_headers_follow_the_nvrtc_major(tmp_path, monkeypatch, nvrtc, want):
    dirs = [_headers(tmp_path / "nofp4", 13000, fp4=False), _headers(tmp_path / "cu13", 13000),
            _headers(tmp_path / "cu12", 12090), _headers(tmp_path / "unknown", None)]
    monkeypatch.setattr(loader, "_header_candidates", lambda: dirs)
    monkeypatch.setattr(loader, "nvrtc_major", lambda: nvrtc)
    loader.cuda_include_dirs.cache_clear()
    try:
        assert loader.cuda_include_dirs() == (str(tmp_path / want),)  # no NVRTC: the first with cuda_fp4.h
    finally:
        loader.cuda_include_dirs.cache_clear()


def test_header_major_reads_cudart_version(tmp_path):
    assert loader.header_major(_headers(tmp_path / "a", 12090)) == 12
    assert loader.header_major(_headers(tmp_path / "b", 13000)) == 13
    assert loader.header_major(_headers(tmp_path / "c", None)) is None
