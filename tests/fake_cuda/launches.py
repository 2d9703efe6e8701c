"""Kernel launches on the fake device: checked and recorded, never run.

Triton: `JITFunction.run` (and the interpreter's `InterpretedFunction.run`, which the test
process uses when TRITON_INTERPRET=1) is replaced by a check that every tensor argument is a
fake `cuda` tensor on the current device and that the grid is legal, and a `Launch` record
(what kernels/triton/compile_check compiles for sm_90a / sm_100a).

CuPy: the `.cu` modules are not compiled; `get_function` checks the kernel exists in the
source, and a launch checks its grid and block and that every pointer argument is the
`data_ptr()` of a fake `cuda` tensor on the current device (fake tensors get unique fake
addresses, so a host pointer or a stale one is caught).
"""

from __future__ import annotations

import contextlib
import inspect
import re

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from .record import Launch, Record, call_site

TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
                torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.int8: "i8", torch.uint8: "u8",
                torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_cooperative_grid", "launch_pdl")
GRID_LIMITS = (2**31 - 1, 65535, 65535)
_BASE, _SPAN = 0x7F00_0000_0000, 1 << 36  # fake device addresses: one span per storage


class FakeAddresses:
    """Unique fake device addresses for fake tensors' data_ptr(), and the way back."""

    def __init__(self):
        self._by_storage: dict[int, int] = {}
        self._devices: dict[int, torch.device] = {}

    def data_ptr(self, t: torch.Tensor) -> int:
        key = t.untyped_storage()._cdata
        base = self._by_storage.get(key)
        if base is None:
            base = self._by_storage[key] = _BASE + len(self._by_storage) * _SPAN
            self._devices[base] = t.device
        return base + t.storage_offset() * t.element_size()

    def device_of(self, pointer: int) -> torch.device | None:
        return self._devices.get((pointer - _BASE) // _SPAN * _SPAN + _BASE) if pointer >= _BASE else None


def _check_grid(record: Record, what: str, grid: tuple[int, ...]) -> None:
    if not 1 <= len(grid) <= 3 or not all(isinstance(g, (int, np.integer)) and g >= 0 for g in grid):
        raise record.fault("grid", f"{what}: launch grid {grid} is not 1-3 non-negative integers")
    for g, limit in zip(grid, GRID_LIMITS):
        if g > limit:
            raise record.fault("grid", f"{what}: launch grid {grid} exceeds the CUDA limits {GRID_LIMITS}")


def _check_tensor(record: Record, what: str, name: str, t: torch.Tensor) -> None:
    current = torch.device("cuda", torch.cuda.current_device())
    if not isinstance(t, FakeTensor) or t.device != current:
        raise record.fault("launch-arg", f"{what}: argument {name} is a {t.device} tensor {tuple(t.shape)}, "
                           f"not on the launching device {current}")


# ---- Triton ------------------------------------------------------------------------------------------

def _params(kernel) -> list[tuple[str, bool]]:
    """(name, is_constexpr) per kernel parameter, for JIT and interpreted kernels alike."""
    if hasattr(kernel, "params"):
        return [(p.name, bool(p.is_constexpr)) for p in kernel.params]
    sig = inspect.signature(kernel.fn)
    return [(name, "constexpr" in str(p.annotation)) for name, p in sig.parameters.items()]


def describe_triton(record: Record, kernel, args, kwargs, grid) -> Launch:
    fn = getattr(kernel, "fn", kernel)
    what = f"{fn.__module__}:{fn.__name__}"
    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
    params = _params(kernel)
    bound = dict(zip([n for n, _ in params], args)) | kwargs
    missing = [n for n, _ in params if n not in bound]
    if missing:
        raise record.fault("launch-arg", f"{what}: missing arguments {missing}")
    signature, constexprs = [], []
    for name, is_constexpr in params:
        value = bound[name]
        if is_constexpr:
            signature.append((name, "constexpr"))
            constexprs.append((name, value))
        elif isinstance(value, torch.Tensor):
            _check_tensor(record, what, name, value)
            signature.append((name, "*" + TRITON_TYPES[value.dtype]))
        elif value is None or isinstance(value, (bool, int, float, np.integer, np.floating)):
            kind = ("constexpr" if value is None else "i1" if isinstance(value, bool)
                    else "fp32" if isinstance(value, (float, np.floating))
                    else "i64" if abs(int(value)) >= 2**31 else "i32")
            signature.append((name, kind))
        else:
            raise record.fault("launch-arg", f"{what}: argument {name} is a {type(value).__name__}")
    if callable(grid):
        grid = grid(bound | options)
    grid = tuple(int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,)))
    _check_grid(record, what, grid)
    return Launch("triton", what, tuple(signature), tuple(constexprs), tuple(sorted(options.items())), grid,
                  call_site(), bool(record.capturing))


def _triton_classes() -> list[type]:
    import triton.runtime.jit as jit

    classes = [jit.JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    return classes


@contextlib.contextmanager
def triton_launches(record: Record):
    saved = {cls: cls.run for cls in _triton_classes()}

    def run(self, *args, grid, warmup=False, **kwargs):
        if warmup:
            return None
        record.launches.append(describe_triton(record, self, args, dict(kwargs), grid))
        return None

    for cls in saved:
        cls.run = run
    try:
        yield
    finally:
        for cls, original in saved.items():
            cls.run = original


# ---- CuPy ----------------------------------------------------------------------------------------------

class FakeRawModule:
    def __init__(self, record: Record, addresses: FakeAddresses, name: str, code: str,
                 name_expressions: tuple[str, ...]):
        self.record, self.addresses, self.name = record, addresses, name
        self.code, self.name_expressions = code, set(name_expressions)

    def get_function(self, kernel: str) -> "FakeKernel":
        base = kernel.split("<", 1)[0]
        known = kernel in self.name_expressions if self.name_expressions else False
        if not known and not re.search(rf"__global__[^;{{]*\b{re.escape(base)}\s*\(", self.code):
            raise self.record.fault("launch", f"kernel {kernel} is not in kernels/cuda/{self.name}.cu")
        return FakeKernel(self, kernel)


class FakeKernel:
    def __init__(self, module: FakeRawModule, name: str):
        self.module, self.name = module, name

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None, **_):
        record, what = self.module.record, f"{self.module.name}:{self.name}"
        grid, block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
        _check_grid(record, what, grid)
        if not 1 <= int(np.prod(block)) <= 1024:
            raise record.fault("grid", f"{what}: block {block} is not 1-1024 threads")
        current = torch.device("cuda", torch.cuda.current_device())
        signature = []
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                raise record.fault("launch-arg", f"{what}: argument {i} is a tensor, not a pointer")
            if isinstance(arg, np.uint64):
                pointer = int(arg)
                device = self.module.addresses.device_of(pointer) if pointer else current
                if device != current:
                    raise record.fault("launch-arg", f"{what}: argument {i} points at "
                                       f"{'host memory' if device is None else device}, not at {current}")
                signature.append((f"arg{i}", "ptr"))
            else:
                signature.append((f"arg{i}", type(arg).__name__))
        record.launches.append(Launch("cupy", what, tuple(signature), (), (("block", block),), grid, call_site(),
                                      bool(record.capturing)))


@contextlib.contextmanager
def cupy_launches(record: Record, addresses: FakeAddresses):
    """Patch the CuPy launch path of kernels/ (module loading and the stream context)."""
    from kernels import cuda_kv, cuda_routing, devices, loader

    def load_module(name, defines=(), name_expressions=()):
        code = loader.source_text(loader.CUDA_DIR / f"{name}.cu", defines)
        return FakeRawModule(record, addresses, name, code, tuple(name_expressions))

    @contextlib.contextmanager
    def cupy_launch(t: torch.Tensor):
        _check_tensor(record, "cupy launch", "device tensor", t)
        yield

    patches = [(m, "load_module", load_module) for m in (loader, cuda_kv, cuda_routing)]
    patches += [(m, "cupy_launch", cupy_launch) for m in (devices, cuda_kv, cuda_routing)]
    importable = devices.importable
    patches.append((devices, "importable", lambda module: module in ("cupy", "triton") or importable(module)))
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    for m, name, value in patches:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)
