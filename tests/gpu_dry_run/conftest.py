"""Dry runs of the GPU path on the fake CUDA device (tests/fake_cuda): skipped where it cannot
run (a CUDA build of torch — the gpu tests cover that machine — or no C++ compiler)."""

from __future__ import annotations

import warnings

import pytest

from tests.fake_cuda import available, fake_cuda


@pytest.fixture
def fake_device():
    """The fake CUDA device for one test; yields its Record."""
    why = available()
    if why is not None:
        pytest.skip(f"fake CUDA device unavailable: {why}")
    with warnings.catch_warnings():
        # torch warns when code reads a fake tensor's storage address (fused_decode's aliasing check)
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with fake_cuda() as record:
            yield record
