"""Shared fixtures: tiny random DeepSeek-V4 checkpoints written once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's interpreter; it must be chosen before any
# kernel module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two cores on CI: keep torch from oversubscribing when tests start worker processes.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _has_cuda() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Build (and cache per session) a random checkpoint: factory(name, preset, layout, **overrides)."""
    from engine.v4.checkpoint import preset_config, random_state, write_checkpoint

    made: dict[str, tuple[str, Path]] = {}

    def make(name: str, preset: str = "tiny", layout: str = "upstream", dtype=torch.float32, quantize=None,
             seed: int = 0, **overrides) -> Path:
        # One name, one checkpoint: which test asks first depends on the run's order (or on
        # how pytest-xdist splits it), so a second spec under a taken name is an error.
        spec = repr((preset, layout, dtype, quantize, seed, sorted(overrides.items())))
        if name not in made:
            cfg = preset_config(preset, **overrides)
            out = tmp_path_factory.mktemp(name)
            write_checkpoint(out, cfg, random_state(cfg, seed), layout=layout, dtype=dtype, quantize=quantize)
            made[name] = (spec, out)
        if made[name][0] != spec:
            raise ValueError(f"checkpoint {name!r} was made as {made[name][0]}, now asked for as {spec}")
        return made[name][1]

    return make
