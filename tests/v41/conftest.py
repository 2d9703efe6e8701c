"""Fixtures for the V4.1 reference tests: the golden data directory and one torch thread.

One thread: the reference is hundreds of small ops, and on a shared 2-core machine OpenMP's
spinning makes each op up to ~500× slower with 2 threads; its results are the same for any
count below 8 (from 8 threads up, some CPU fp32 GEMM kernels change).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN_ROOT = REPO_ROOT.parent / "shared" / "golden" / "deepseek-v4.1"


@pytest.fixture(scope="session")
def golden_root() -> Path:
    if not (GOLDEN_ROOT / "c1" / "golden.json").exists():
        pytest.skip(f"V4.1 golden data not found at {GOLDEN_ROOT}")
    return GOLDEN_ROOT


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
