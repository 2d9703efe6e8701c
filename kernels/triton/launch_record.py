"""Triton launches as data: what a kernel was called with, recorded instead of launched.

A `LaunchRecord` holds everything `triton.compile` needs to build the same specialisation the
JIT would build for a launch (the kernel by module and qualified name, each parameter's Triton
type, the constexpr values, the divisibility attributes, the launch options) plus its grid. It
is plain JSON, so a dry run of the engine (fake CUDA tensors) can write the launches it makes and
`kernels/triton/compile_check.py` compile them later, in another process, for any target.

`recording()` swaps `JITFunction.run` (and `Autotuner.run`: every config is recorded) for a
recorder that launches nothing. It reads only a tensor's dtype, device, storage offset and
element size, never its data, so it takes `meta` tensors and fake (FakeTensorMode) `cuda`
tensors alike. Specialisation follows Triton's JIT (runtime/jit.py
`create_function_from_signature`): an int equal to 1 becomes the constexpr 1, ints divisible by
16 get the divisibility attribute, as do tensors whose address is (a 16-byte multiple past an
allocation start: the caching allocator aligns every allocation to 512 bytes).
"""
from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

FORMAT_VERSION = 1
ALIGNMENT = 16                     # bytes; Triton's pointer and integer divisibility specialisation
JsonScalar = int | float | bool | str | None
# on_launch(kernel, arguments by parameter name, grid, record): raise to report a bad launch.
LaunchHook = Callable[[JITFunction, dict[str, Any], tuple[int, ...], "LaunchRecord"], None]


@dataclass(frozen=True)
class LaunchRecord:
    """One Triton launch. ``kernel`` is "module:qualname"; ``signature`` maps every parameter to
    its Triton type ("*bf16", "i32", "fp32", "u1", "constexpr"); ``constexprs`` their values;
    ``attrs`` the parameters specialised as 16-divisible ("D"); ``options`` num_warps,
    num_stages, ... as passed (Triton's defaults otherwise); ``label`` says where it came from."""

    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, JsonScalar]
    attrs: dict[str, str]
    options: dict[str, JsonScalar]
    grid: tuple[int, ...]
    label: str = ""

    @property
    def name(self) -> str:
        return self.kernel.rpartition(":")[2].rpartition(".")[2]

    def spec_key(self) -> str:
        """Identical for launches that compile to the same binary (grid and label aside)."""
        return json.dumps([self.kernel, self.signature, self.constexprs, self.attrs, self.options], sort_keys=True)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "grid": list(self.grid)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "LaunchRecord":
        missing = {"kernel", "signature", "constexprs", "attrs", "options", "grid"} - raw.keys()
        if missing:
            raise ValueError(f"launch record lacks {sorted(missing)}: {raw!r:.200}")
        return cls(str(raw["kernel"]), dict(raw["signature"]), dict(raw["constexprs"]), dict(raw["attrs"]),
                   dict(raw["options"]), tuple(int(g) for g in raw["grid"]), str(raw.get("label", "")))

    def jit_function(self) -> JITFunction:
        """The kernel itself (importing its module); autotuner/heuristics wrappers unwrapped."""
        module, _, qualname = self.kernel.partition(":")
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
            obj = obj.fn
        if not isinstance(obj, JITFunction):
            raise TypeError(f"{self.kernel} is not a Triton JIT function (run without TRITON_INTERPRET)")
        return obj


def save_records(path: str | Path, records: Sequence[LaunchRecord]) -> None:
    Path(path).write_text(json.dumps({"version": FORMAT_VERSION, "launches": [r.to_json() for r in records]},
                                     indent=1) + "\n")


def load_records(path: str | Path) -> list[LaunchRecord]:
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, dict) or raw.get("version") != FORMAT_VERSION or not isinstance(raw.get("launches"), list):
        raise ValueError(f"{path}: not a launch-record file (want {{'version': {FORMAT_VERSION}, 'launches': [...]}})")
    return [LaunchRecord.from_json(r) for r in raw["launches"]]


# ---- specialisation -------------------------------------------------------------------------------

@cache
def _backend_class() -> type:
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend


def _native(value: Any, is_const: bool, specialize: bool, align: bool) -> tuple[str, Any]:
    from triton._C.libtriton import native_specialize_impl

    return native_specialize_impl(_backend_class(), value, is_const, specialize, align)


@cache
def _pointer_type(dtype: torch.dtype, is_const: bool) -> str:
    """Triton's pointer type for a torch dtype, from Triton itself (a real meta tensor: no data;
    made outside any FakeTensorMode, whose fake tensors warn when Triton asks for an address)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily():
            return _native(torch.empty(1, dtype=dtype, device="meta"), is_const, True, True)[0]
    except Exception as exc:  # noqa: BLE001 - a dtype Triton has no pointer type for
        raise TypeError(f"Triton takes no pointer to {dtype} (view it as an integer dtype)") from exc


def _json_value(name: str, value: Any) -> JsonScalar:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, triton.language.dtype):
        raise TypeError(f"constexpr {name}: tl.dtype values are not recordable yet; pass a str or int")
    raise TypeError(f"constexpr {name}={value!r} is not a JSON scalar")


def _specialize(kp, value: Any) -> tuple[str, str | None, JsonScalar]:
    """(Triton type, attribute or None, constexpr value) of one non-constexpr argument."""
    specialize, align = not kp.do_not_specialize, not kp.do_not_specialize_on_alignment
    if isinstance(value, torch.Tensor):
        aligned = value.storage_offset() * value.element_size() % ALIGNMENT == 0
        return _pointer_type(value.dtype, kp.is_const), "D" if align and aligned else None, None
    if isinstance(value, torch.SymInt):
        raise TypeError(f"{kp.name}: a symbolic int; the recorder needs static shapes")
    try:
        kind, attr = _native(value, kp.is_const, specialize, align)
    except Exception as exc:  # noqa: BLE001 - what a real launch would reject too (e.g. numpy scalars)
        raise TypeError(f"argument {kp.name}: Triton cannot launch a {type(value).__name__} ({exc})") from exc
    if kind == "constexpr":                       # ints equal to 1, and None
        return kind, None, _json_value(kp.name, value)
    annotated = kp.annotation_type
    if annotated:                                 # as the JIT: annotated floats and bools never specialise
        keep = specialize and not (annotated == "u1" or annotated[:2] in ("fp", "bf"))
        return annotated, attr if keep and attr else None, None
    return kind, attr or None, None


_JIT_VIEWS: dict[Any, JITFunction] = {}


def as_jit(kernel: Any) -> JITFunction:
    """The JITFunction of a kernel: itself, or for the interpreter's InterpretedFunction (a
    TRITON_INTERPRET=1 process) one built from the same Python function and decorator options,
    so a launch made under the interpreter records what the compiled JIT would specialise."""
    if isinstance(kernel, JITFunction):
        return kernel
    view = _JIT_VIEWS.get(kernel.fn)
    if view is None:
        view = _JIT_VIEWS[kernel.fn] = JITFunction(kernel.fn, **getattr(kernel, "kwargs", {}))
    return view


def specialize_launch(kernel: Any, args: Sequence[Any], kwargs: dict[str, Any], grid: Any,
                      label: str = "") -> tuple[LaunchRecord, dict[str, Any]]:
    """The record of ``kernel[grid](*args, **kwargs)`` (a JITFunction or an InterpretedFunction)
    and its arguments by parameter name. ``kwargs`` is consumed (launch options popped)."""
    fn = as_jit(kernel)
    names = {p.name for p in fn.params}
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in names}
    bound = fn.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    signature, constexprs, attrs = {}, {}, {}
    for kp in fn.params:
        value = values[kp.name]
        if kp.is_constexpr:
            signature[kp.name], constexprs[kp.name] = "constexpr", _json_value(kp.name, value)
            continue
        kind, attr, const = _specialize(kp, value)
        signature[kp.name] = kind
        if kind == "constexpr":
            constexprs[kp.name] = const
        elif attr:
            attrs[kp.name] = attr
    for key in ("debug", "instrumentation_mode", "fpsan_homomorphic_casts"):
        options.pop(key, None)                    # set by JITFunction.run from knobs, not by the caller
    grid = grid(values) if callable(grid) else grid
    try:
        grid = tuple(int(g) for g in grid)
    except Exception as exc:  # noqa: BLE001 - a data-dependent grid under fake tensors
        raise ValueError(f"{fn.__name__}: the grid {grid!r} is not static ints") from exc
    options = {k: _json_value(k, v) for k, v in sorted(options.items())}
    kernel = f"{fn.fn.__module__}:{fn.fn.__qualname__}"
    return LaunchRecord(kernel, signature, constexprs, attrs, options, grid, label), values


# ---- the recorder -----------------------------------------------------------------------------------

@dataclass
class Recorder:
    """What `recording` collects. ``label`` is stamped on each new record: a string (change it
    between calls) or a function called per launch (e.g. one naming the call site)."""

    records: list[LaunchRecord] = field(default_factory=list)
    label: str | Callable[[], str] = ""
    on_launch: LaunchHook | None = None

    def current_label(self) -> str:
        return self.label() if callable(self.label) else self.label


def _kernel_classes() -> list[type]:
    classes: list[type] = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every Triton 3 ships the interpreter
        return classes
    return classes + [InterpretedFunction]


@contextmanager
def recording(label: str | Callable[[], str] = "", on_launch: LaunchHook | None = None) -> Iterator[Recorder]:
    """Record every Triton launch inside the block instead of running it (compiled JIT kernels
    and, in a TRITON_INTERPRET=1 process, interpreted ones alike).

    ``on_launch(kernel, args, grid, record)`` is called first for each launch (args by parameter
    name, tensors as passed): a checker raises there to reject it. An autotuned kernel records one
    launch per config (its pre-hooks, which touch data, are not run). Not re-entrant.
    """
    rec = Recorder(label=label, on_launch=on_launch)
    saved = {cls: cls.run for cls in _kernel_classes()}
    original_tune = Autotuner.run

    def run(self, *args, grid, warmup=False, **kwargs):
        record, values = specialize_launch(self, args, dict(kwargs), grid, rec.current_label())
        if rec.on_launch is not None:
            rec.on_launch(self, values, record.grid, record)
        rec.records.append(record)
        return None

    def tune(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        try:
            for config in self.prune_configs(kwargs):
                self.fn.run(*args, **kwargs, **config.all_kwargs())
        finally:
            self.nargs = None

    for cls in saved:
        cls.run = run
    Autotuner.run = tune
    try:
        yield rec
    finally:
        for cls, original in saved.items():
            cls.run = original
        Autotuner.run = original_tune


def unique(records: Sequence[LaunchRecord]) -> list[tuple[LaunchRecord, list[str]]]:
    """Distinct specialisations in first-seen order, each with the labels that launched it."""
    seen: dict[str, tuple[LaunchRecord, list[str]]] = {}
    for r in records:
        entry = seen.setdefault(r.spec_key(), (r, []))
        if r.label not in entry[1]:
            entry[1].append(r.label)
    return list(seen.values())
