"""What a dry run on the fake CUDA device saw: host transfers, waits, kernel launches, faults.

A *fault* is something that would fail or silently misbehave on a real GPU (a host read or a
synchronize while a CUDA graph is being captured, a CPU tensor in a CUDA op, a dtype a kernel
does not take, ...). Faults raise `FakeCudaFault` at once, at the offending call, so the
traceback points at the engine line; everything else is recorded for the test to count.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

_HERE = str(Path(__file__).parent)
_ROOT = str(Path(__file__).resolve().parents[2])


class FakeCudaFault(AssertionError):
    """A GPU first-day failure seen on the fake device; the message names the kind and the call site."""

    def __init__(self, kind: str, detail: str, where: str):
        super().__init__(f"[{kind}] {detail} (at {where})")
        self.kind, self.detail, self.where = kind, detail, where


def call_site(skip: tuple[str, ...] = ()) -> str:
    """'path:line' of the innermost frame in this repository outside tests/fake_cuda (the engine
    or test line that made the call), else the innermost frame at all."""
    frame = sys._getframe(1)
    first = None
    while frame is not None:
        name = frame.f_code.co_filename
        first = first or f"{name}:{frame.f_lineno}"
        if name.startswith(_ROOT) and not name.startswith(_HERE) and "/.venv/" not in name \
                and not any(s in name for s in skip):
            return f"{name[len(_ROOT) + 1:]}:{frame.f_lineno}"
        frame = frame.f_back
    return first or "?"


@dataclass(frozen=True)
class Transfer:
    kind: str  # 'd2h' (a device-to-host read), 'h2d' (host data copied to the device), 'wait' (host waits)
    op: str  # the aten op or API call
    where: str  # call site (see call_site)
    nbytes: int = 0
    # A d2h the host waits for (.item(), .tolist(), a pageable copy); False: a non-blocking copy
    # into pinned memory, which the host waits for later (Event.synchronize: a 'wait').
    blocking: bool = True


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the engine made it (what kernels/triton/compile_check compiles)."""

    toolkit: str  # 'triton' | 'cupy'
    kernel: str  # Triton: module:function; CuPy: module name:kernel name
    signature: tuple[tuple[str, str], ...]  # (parameter, type) — '*bf16', 'i32', 'constexpr', ...
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...]
    grid: tuple[int, ...]
    where: str
    captured: bool


@dataclass
class Record:
    transfers: list[Transfer] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    collectives: list = field(default_factory=list)  # (op, sizes, call site, captured) per collective
    capturing: int = 0  # nesting depth of graph captures in progress
    captures: int = 0  # graphs captured
    replays: int = 0

    def reads(self) -> list[Transfer]:
        return [t for t in self.transfers if t.kind == "d2h"]

    def syncs(self, mark: int = 0) -> list[Transfer]:
        """Everything since `mark` that blocks the host on the device: blocking reads and waits."""
        return [t for t in self.transfers[mark:] if t.kind == "wait" or (t.kind == "d2h" and t.blocking)]

    def mark(self) -> int:
        return len(self.transfers)

    def since(self, mark: int, kind: str | None = None) -> list[Transfer]:
        return [t for t in self.transfers[mark:] if kind is None or t.kind == kind]

    def fault(self, kind: str, detail: str) -> FakeCudaFault:
        return FakeCudaFault(kind, detail, call_site())
