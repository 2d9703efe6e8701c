"""A CPU stand-in for torch.cuda.set_sync_debug_mode: count the calls that wait for the device."""

from __future__ import annotations

import contextlib
import sys

import torch

from engine.step_sampling import PendingRead

# The Tensor calls that wait for the device on CUDA. numpy() is not among them: on a CUDA tensor
# it raises, so a device read always goes through one of these first.
_SYNCING = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "nonzero")
# CPU-only kernel implementations (numba routing and their argument range checks): on a GPU the
# Triton kernels behind the same dispatch run instead, so their host reads are not the step's.
_CPU_ONLY = ("kernels/cpu_", "kernels/checks.py")


@contextlib.contextmanager
def count_host_reads():
    """Collects (call, file:line) of every syncing Tensor call outside the CPU-only kernels, and
    of every wait for a step's results (`PendingRead.wait`: on CUDA it waits for the copy's
    event). On CPU nothing waits, so a step that makes one such call here makes one host sync on
    a GPU."""
    calls: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in _SYNCING}
    saved_wait = PendingRead.wait

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if not any(part in caller for part in _CPU_ONLY):
                calls.append(f"{name} {caller}:{sys._getframe(1).f_lineno}")
            return fn(self, *args, **kwargs)
        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    PendingRead.wait = wrap("PendingRead.wait", saved_wait)
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        PendingRead.wait = saved_wait
