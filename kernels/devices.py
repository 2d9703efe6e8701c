"""Device rules shared by every op: which implementation runs, and where GPU work launches.

An op's tensor arguments must all live on one device. CPU tensors run the CPU (numba/torch)
implementation; CUDA tensors run the GPU one, and when its toolkit (CuPy for the .cu kernels,
Triton for the Triton kernels) does not import that is an error, never a silent fall back to
the CPU path (which would read GPU memory through a host copy per call, or fail deep inside).
GPU work launches on the tensors' device and on torch's current stream of that device, so it
is ordered with the torch work around it (CUDA graphs, side streams).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from collections.abc import Iterator, Mapping

import torch

TOOLKITS = {"cupy": "CuPy (pip install cupy-cuda12x)", "triton": "Triton (pip install triton)"}


@functools.cache
def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a toolkit that fails to import (missing CUDA libs) is absent
        return False
    return True


def choose_backend(op: str, devices: Mapping[str, torch.device], toolkit: str, toolkit_ok: bool) -> str:
    """'cpu' or 'cuda' for an op whose named tensor arguments live on ``devices``.

    Raises ValueError for arguments on different devices or on a device type other than cpu and
    cuda, and RuntimeError for CUDA arguments when ``toolkit`` is not importable.
    """
    distinct = set(devices.values())
    if len(distinct) > 1:
        where = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"{op}: all tensor arguments must be on one device, got {where}")
    if not distinct:
        return "cpu"
    (device,) = distinct
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"{op}: tensors on {device} are not supported (cpu or cuda only)")
    if not toolkit_ok:
        raise RuntimeError(f"{op}: the inputs are on {device} but {TOOLKITS[toolkit]} is not importable; "
                           f"the CPU implementation does not take CUDA tensors")
    return "cuda"


def backend(op: str, toolkit: str, **tensors: torch.Tensor | None) -> str:
    """choose_backend for the given tensor arguments (None arguments are skipped). The toolkit is
    imported only for CUDA arguments: a CPU process never loads Triton or CuPy (a CPU install may
    lack them, and Triton costs a second of start-up and prints binding leaks at exit)."""
    if all(t is None or t.is_cpu for t in tensors.values()):
        return "cpu"        # the common case without the device map (~1 of ~5 us; ~150 ops a CPU step)
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    on_cuda = any(d.type == "cuda" for d in devices.values())
    return choose_backend(op, devices, toolkit, on_cuda and importable(toolkit))


@contextlib.contextmanager
def cupy_launch(t: torch.Tensor) -> Iterator[None]:
    """CuPy's current device = t's device and its current stream = torch's current stream there."""
    import cupy

    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
        yield


# ---- the fused decode kernels' backend -------------------------------------------------------------

_TRITON_ON_CPU = contextvars.ContextVar("ringserve_triton_on_cpu", default=False)


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Run the fused decode ops' Triton kernels on CPU tensors (Triton's interpreter): how tests
    and perf/bench_gpu_ops.py exercise the GPU path without a GPU. TRITON_INTERPRET=1 must have
    been set before the first Triton import."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton_on_cpu needs TRITON_INTERPRET=1 set before Triton is imported")
    token = _TRITON_ON_CPU.set(True)
    try:
        yield
    finally:
        _TRITON_ON_CPU.reset(token)


def decode_backend(op: str, **tensors: torch.Tensor | None) -> str:
    """'triton' or 'cpu' for a fused decode op: CUDA tensors run Triton, CPU tensors the CPU
    kernels (kernels/cpu_decode.py) unless inside `triton_on_cpu`."""
    if backend(op, "triton", **tensors) == "cuda" or _TRITON_ON_CPU.get():
        return "triton"
    return "cpu"
