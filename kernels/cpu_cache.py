"""numba's on-disk cache for the CPU kernels, invalidated by any change to any kernel module.

numba checks a cached function against its own source file only, but a jitted function carries
the jitted functions it calls compiled into it: kernels/cpu_step.py's whole decode step holds
the code of a dozen kernel modules. Edit one of them (or upgrade to a ringserve that did) and the
step's cache would keep running the old code. Here every function defined in this directory is
stamped with a digest of all its Python sources (the contents, as numba's own stamp hashes one
file), so any edit recompiles them all, and `ringserve warm-kernels` recompiles at install.

Installed from kernels/cpu_numerics.py, the first kernel module the package imports, before any
kernel is decorated (numba picks a function's cache locator when it is decorated).
"""
from __future__ import annotations

import functools
import hashlib
import os

from numba.core import caching

KERNELS_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=8)
def _digest(listing: tuple) -> bytes:
    h = hashlib.sha256()
    for name, _, _ in listing:
        with open(os.path.join(KERNELS_DIR, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.digest()


def sources_stamp() -> bytes:
    """A digest of every .py file in this directory (re-read when a file's mtime or size changes)."""
    listing = []
    for name in sorted(os.listdir(KERNELS_DIR)):
        if name.endswith(".py"):
            st = os.stat(os.path.join(KERNELS_DIR, name))
            listing.append((name, st.st_mtime_ns, st.st_size))
    return _digest(tuple(listing))


class _AllKernelSources:
    """Locator mixin: functions of this directory only, stamped with `sources_stamp`."""

    def get_source_stamp(self):
        return sources_stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.dirname(os.path.abspath(py_file)) != KERNELS_DIR:
            return None
        return super().from_function(py_func, py_file)


class UserDirLocator(_AllKernelSources, caching.UserProvidedCacheLocator):
    """NUMBA_CACHE_DIR set."""


class InTreeLocator(_AllKernelSources, caching.InTreeCacheLocator):
    """kernels/__pycache__ writable."""


class UserWideLocator(_AllKernelSources, caching.UserWideCacheLocator):
    """Otherwise: the user's cache directory."""


LOCATORS = (UserDirLocator, InTreeLocator, UserWideLocator)


def install() -> None:
    """Put the locators ahead of numba's own (idempotent)."""
    classes = caching.CacheImpl._locator_classes
    if classes[: len(LOCATORS)] != list(LOCATORS):
        classes[:0] = [c for c in LOCATORS if c not in classes]


install()
