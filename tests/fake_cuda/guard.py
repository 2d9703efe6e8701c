"""Build and load the fake CUDA device guard (guard.cpp) into this process, once.

The shared object is compiled with the machine's C++ compiler against the installed torch's
headers and libc10, into a cache directory keyed by the torch version and the source's hash,
and loaded with RTLD_GLOBAL so its static registrar runs. A process that already has a CUDA
guard (a CUDA build of torch) needs none.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("guard.cpp")


class GuardBuildError(RuntimeError):
    """The fake guard could not be compiled (no C++ compiler, or torch's headers missing)."""


def _cache_dir() -> Path:
    root = os.environ.get("RINGSERVE_FAKE_CUDA_CACHE") or os.path.join(tempfile.gettempdir(), "ringserve-fake-cuda")
    return Path(root)


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise GuardBuildError("no C++ compiler found (set CXX or install g++)")


def build() -> Path:
    """The compiled guard library, built if missing. Builds into a temporary name and renames,
    so concurrent test processes never load a half-written file."""
    torch_dir = Path(torch.__file__).parent
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    out = _cache_dir() / f"fake_cuda_guard-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [_compiler(), "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{torch_dir / 'include'}", str(SOURCE),
           f"-L{torch_dir / 'lib'}", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise GuardBuildError(f"compiling {SOURCE.name} failed:\n{done.stderr[-4000:]}")
    os.replace(tmp, out)
    return out


@functools.cache
def load() -> ctypes.CDLL:
    """Register the fake CUDA guard in this process (idempotent); the library, whose two
    functions get and set the calling thread's current fake device."""
    if torch.version.cuda is not None:
        raise GuardBuildError("a CUDA build of torch has a real CUDA guard; the fake one is for CPU builds")
    lib = ctypes.CDLL(str(build()), mode=ctypes.RTLD_GLOBAL)
    lib.ringserve_fake_cuda_set_device.argtypes = [ctypes.c_int]
    return lib
