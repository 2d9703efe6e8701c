"""A fake CUDA device for CPU-only test machines: dry runs of ringserve's GPU path.

    with fake_cuda() as record:
        model = load_model(ckpt, device="cuda")      # fake cuda tensors: shapes, dtypes, devices
        ...                                          # capture, replay, engine steps
    record.transfers / record.launches               # host reads and writes, waits, kernel launches

Inside the context, tensors on `cuda` are torch FakeTensors (no data; the C++ device guard of
guard.cpp lets a CPU build of torch hold them), CPU tensors stay real, `torch.cuda`'s runtime
API has stand-ins (runtime.py), and kernel launches are checked and recorded instead of run
(launches.py), and collectives on fake tensors are checked and agreed across the real group
instead of run (collectives.py). What would fail or silently go wrong on a GPU raises `FakeCudaFault`
(dispatch.py lists the checks). What it cannot show: numerics, timings, races — a real GPU
run (scripts/gpu_check.sh) does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import guard
from .collectives import fake_collectives
from .dispatch import FakeCudaMode
from .launches import FakeAddresses, cupy_launches, triton_launches
from .record import FakeCudaFault, Launch, Record, Transfer
from .runtime import Runtime, patches

__all__ = ["FakeCudaFault", "Launch", "Record", "Transfer", "fake_cuda", "current_runtime", "available"]

_RUNTIME: list[Runtime] = []


def available() -> str | None:
    """None when the fake device can run in this process, else why not."""
    if torch.version.cuda is not None:
        return "a CUDA build of torch: the real device is checked by the gpu tests (scripts/gpu_check.sh)"
    try:
        guard.build()
    except guard.GuardBuildError as exc:
        return str(exc)
    return None


# Constructors from Python data: torch builds them on the target device below the dispatch
# modes, so a `cuda` one is built on the host and moved (one host-to-device copy, as on a GPU).
_CONSTRUCTORS = ("tensor", "as_tensor", "asarray")


def _via_host(ctor):
    def construct(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            return ctor(*args, **kwargs).to(device)
        return ctor(*args, device=device, **kwargs)

    return construct


def _host_lists(index):
    """Index lists as CPU int64 tensors: torch would build them on the indexed tensor's device
    below the dispatch modes."""
    if isinstance(index, list):
        return torch.tensor(index, dtype=torch.long if not any(isinstance(i, bool) for i in index) else torch.bool)
    if isinstance(index, tuple):
        return tuple(_host_lists(i) for i in index)
    return index


def current_runtime() -> Runtime:
    return _RUNTIME[-1]


@contextlib.contextmanager
def fake_cuda(device_count: int = 1, fill: int = 1) -> Iterator[Record]:
    """Run the block with a fake CUDA device; yields the record of what the block did on it.
    `fill`: the value host copies of device data read as."""
    if _RUNTIME:
        raise RuntimeError("fake_cuda() is not reentrant")
    lib = guard.load()
    record = Record()
    runtime = Runtime(record, lib, device_count)
    addresses = FakeAddresses()
    saved = {name: getattr(torch.cuda, name) for name in patches(runtime)}
    saved_ctors = {name: getattr(torch, name) for name in _CONSTRUCTORS}
    saved_ptr = FakeTensor.__dict__.get("data_ptr")
    _RUNTIME.append(runtime)
    for name, value in patches(runtime).items():
        setattr(torch.cuda, name, value)
    FakeTensor.data_ptr = lambda self: addresses.data_ptr(self)
    FakeTensor.__getitem__ = lambda self, index: torch.Tensor.__getitem__(self, _host_lists(index))
    FakeTensor.__setitem__ = lambda self, index, value: torch.Tensor.__setitem__(self, _host_lists(index), value)
    for name, ctor in saved_ctors.items():
        setattr(torch, name, _via_host(ctor))
    lib.ringserve_fake_cuda_set_device(0)
    try:
        with (triton_launches(record), cupy_launches(record, addresses), fake_collectives(record) as collectives,
              FakeCudaMode(record, fill)):
            record.collectives = collectives.calls
            yield record
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        for name, value in saved_ctors.items():
            setattr(torch, name, value)
        for name in ("data_ptr", "__getitem__", "__setitem__"):
            if name in FakeTensor.__dict__:
                delattr(FakeTensor, name)
        if saved_ptr is not None:
            FakeTensor.data_ptr = saved_ptr
        _RUNTIME.pop()
