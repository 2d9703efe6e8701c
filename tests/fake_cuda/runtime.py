"""Stand-ins for the `torch.cuda` runtime API on the fake device: devices, streams, events,
CUDA graphs, memory queries and the sync debug mode.

They keep the bookkeeping a real GPU would enforce: a synchronize, an event or stream wait, or
a graph replay while a graph is being captured is a fault; host waits are recorded; a capture
raises at its end if the captured region made a host read. Nothing runs: a replay does no work
(the captured outputs are fake tensors already), so dry runs check where data and control go,
never values.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import warnings
from types import SimpleNamespace

import torch

from .record import Record, Transfer, call_site

_stream_ids = itertools.count(1)  # 0 is each device's default stream


class Runtime:
    """Everything the patched `torch.cuda` functions share: the record, the guard library, the
    current stream per thread, the device's size."""

    def __init__(self, record: Record, guard: ctypes.CDLL, device_count: int = 1, total_memory: int = 141 << 30):
        self.record, self.guard = record, guard
        self.device_count, self.total_memory = device_count, total_memory
        self.sync_debug_mode = 0  # torch.cuda.set_sync_debug_mode: 0 default, 1 warn, 2 error
        self.local = threading.local()

    # ---- devices -------------------------------------------------------------------------------
    def current_device(self) -> int:
        return self.guard.ringserve_fake_cuda_get_device()

    def set_device(self, device) -> None:
        index = _index(device, self.current_device())
        if not 0 <= index < self.device_count:
            raise RuntimeError(f"fake cuda: device {index} does not exist ({self.device_count} devices)")
        self.guard.ringserve_fake_cuda_set_device(index)

    # ---- streams -------------------------------------------------------------------------------
    def current_stream(self, device=None) -> "FakeStream":
        stack = self._stack()
        if stack:
            return stack[-1]
        index = _index(device, self.current_device())
        defaults = getattr(self.local, "defaults", None) or {}
        self.local.defaults = defaults
        if index not in defaults:
            defaults[index] = FakeStream(self, device=index, stream_id=0)
        return defaults[index]

    def _stack(self) -> list:
        if not hasattr(self.local, "streams"):
            self.local.streams = []
        return self.local.streams

    @contextlib.contextmanager
    def stream(self, stream):
        if stream is None:
            yield
            return
        self._stack().append(stream)
        try:
            yield
        finally:
            self._stack().pop()

    # ---- host waits ----------------------------------------------------------------------------
    def host_wait(self, what: str) -> None:
        """A call that blocks the host until the device catches up."""
        if self.record.capturing:
            raise self.record.fault("sync-in-capture", f"{what} while a CUDA graph is being captured")
        self.sync_seen(what, "wait")

    def sync_seen(self, what: str, kind: str, nbytes: int = 0, blocking: bool = True) -> None:
        self.record.transfers.append(Transfer(kind, what, call_site(), nbytes, blocking))
        if not blocking:
            return
        if self.sync_debug_mode == 1:
            warnings.warn(f"called a synchronizing CUDA operation: {what}", stacklevel=3)
        elif self.sync_debug_mode == 2:
            raise RuntimeError(f"called a synchronizing CUDA operation: {what}")

    def set_sync_debug_mode(self, mode) -> None:
        self.sync_debug_mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)

    # ---- graphs --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self, graph: "FakeGraph"):
        if self.record.capturing:
            raise self.record.fault("nested-capture", "a CUDA graph capture inside another")
        self.record.capturing += 1
        try:
            yield
        finally:
            self.record.capturing -= 1
        graph.captured = True
        self.record.captures += 1

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total_memory, self.total_memory

    def properties(self, device=None):
        return SimpleNamespace(name="fake-cuda (H200-shaped)", major=9, minor=0, total_memory=self.total_memory,
                               multi_processor_count=132, max_threads_per_multi_processor=2048,
                               warp_size=32, regs_per_multiprocessor=65536, L2_cache_size=50 << 20)


def _index(device, current: int) -> int:
    if device is None:
        return current
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return current if device.index is None else device.index


class FakeStream:
    def __init__(self, runtime: Runtime, device=None, priority: int = 0, stream_id: int | None = None, **_):
        self.runtime = runtime
        self.device_index = _index(device, runtime.current_device())
        self.device = torch.device("cuda", self.device_index)
        self.stream_id = next(_stream_ids) if stream_id is None else stream_id
        self.cuda_stream = 0x5000 + self.stream_id  # what CuPy's ExternalStream would take

    def wait_stream(self, other: "FakeStream") -> None:
        pass  # a device-side dependency: no host wait

    def wait_event(self, event: "FakeEvent") -> None:
        pass

    def record_event(self, event: "FakeEvent | None" = None) -> "FakeEvent":
        event = event or FakeEvent(self.runtime)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.runtime.host_wait("Stream.synchronize")

    def query(self) -> bool:
        if self.runtime.record.capturing:
            raise self.runtime.record.fault("sync-in-capture", "Stream.query while a CUDA graph is being captured")
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStream) and (other.device_index, other.stream_id) == (self.device_index,
                                                                                           self.stream_id)

    def __hash__(self) -> int:
        return hash((self.device_index, self.stream_id))

    def __enter__(self):
        self.runtime._stack().append(self)
        return self

    def __exit__(self, *exc):
        self.runtime._stack().pop()


class FakeEvent:
    def __init__(self, runtime: Runtime, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **_):
        self.runtime, self.recorded = runtime, False

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded = True

    def wait(self, stream: FakeStream | None = None) -> None:
        pass  # the stream waits on the device

    def query(self) -> bool:
        if self.runtime.record.capturing:
            raise self.runtime.record.fault("sync-in-capture", "Event.query while a CUDA graph is being captured")
        return True

    def synchronize(self) -> None:
        self.runtime.host_wait("Event.synchronize")

    def elapsed_time(self, end: "FakeEvent") -> float:
        self.runtime.host_wait("Event.elapsed_time")
        return 0.0


class FakeGraph:
    """torch.cuda.CUDAGraph: capture marks the region; replay runs nothing (values are fake)."""

    def __init__(self, runtime: Runtime, keep_graph: bool = False):
        self.runtime, self.captured, self._pool = runtime, False, object()

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        self._ctx = self.runtime.capture(self)
        self._ctx.__enter__()

    def capture_end(self) -> None:
        self._ctx.__exit__(None, None, None)

    def replay(self) -> None:
        record = self.runtime.record
        if record.capturing:
            raise record.fault("replay-in-capture", "a graph replayed while another is being captured")
        if not self.captured:
            raise record.fault("replay-uncaptured", "a CUDA graph replayed before it was captured")
        record.replays += 1

    def reset(self) -> None:
        self.captured = False

    def pool(self):
        return self._pool

    def enable_debug_mode(self) -> None:
        pass


def patches(rt: Runtime) -> dict[str, object]:
    """torch.cuda attribute → stand-in."""

    @contextlib.contextmanager
    def graph(cuda_graph: FakeGraph, pool=None, stream=None, capture_error_mode: str = "global"):
        with rt.stream(stream or FakeStream(rt)), rt.capture(cuda_graph):
            yield

    @contextlib.contextmanager
    def device(d):
        before = rt.current_device()
        if d is not None and _index(d, before) >= 0:
            rt.set_device(d)
        try:
            yield
        finally:
            rt.set_device(before)

    return {
        "is_available": lambda: True, "is_initialized": lambda: True, "init": lambda: None,
        "device_count": lambda: rt.device_count, "current_device": rt.current_device, "set_device": rt.set_device,
        "device": device, "get_device_properties": rt.properties,
        "get_device_capability": lambda d=None: (9, 0), "get_device_name": lambda d=None: rt.properties().name,
        "is_bf16_supported": lambda *a, **k: True,
        "synchronize": lambda d=None: rt.host_wait("torch.cuda.synchronize"),
        "mem_get_info": rt.mem_get_info, "empty_cache": lambda: None,
        "memory_allocated": lambda d=None: 0, "max_memory_allocated": lambda d=None: 0,
        "reset_peak_memory_stats": lambda d=None: None,
        "manual_seed": lambda s: None, "manual_seed_all": lambda s: None,
        "Stream": lambda *a, **k: FakeStream(rt, *a, **k), "ExternalStream": lambda *a, **k: FakeStream(rt),
        "Event": lambda *a, **k: FakeEvent(rt, *a, **k), "CUDAGraph": lambda *a, **k: FakeGraph(rt, *a, **k),
        "graph": graph, "graph_pool_handle": lambda: object(), "stream": rt.stream,
        "current_stream": rt.current_stream, "default_stream": rt.current_stream,
        "set_stream": lambda s: None, "is_current_stream_capturing": lambda: bool(rt.record.capturing),
        "set_sync_debug_mode": rt.set_sync_debug_mode, "get_sync_debug_mode": lambda: rt.sync_debug_mode,
    }
