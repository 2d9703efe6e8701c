"""kernels/cpu_cache.py: every CPU kernel's on-disk cache is stamped with all the kernel sources."""
from __future__ import annotations

import os
import shutil
import sys

from numba.core.registry import CPUDispatcher

import kernels
import kernels.cpu_step  # noqa: F401  (the compiled decode step: a kernel that inlines a dozen others)
import kernels.sinkhorn  # noqa: F401
from kernels import cpu_cache


def _kernel_dispatchers():
    for name, module in list(sys.modules.items()):
        if name.startswith("kernels.") and os.path.dirname(getattr(module, "__file__", "") or "") == cpu_cache.KERNELS_DIR:
            for attr, obj in vars(module).items():
                if isinstance(obj, CPUDispatcher) and obj._cache is not None and hasattr(obj._cache, "_impl"):
                    yield f"{name}.{attr}", obj


def test_every_cached_kernel_is_stamped_with_all_kernel_sources():
    found = dict(_kernel_dispatchers())
    assert "kernels.cpu_step.run_step" in found and "kernels.cpu_attention._decode_serial" in found
    wrong = [name for name, d in found.items() if not isinstance(d._cache._impl.locator, cpu_cache.LOCATORS)]
    assert not wrong
    stamps = {d._cache._impl.locator.get_source_stamp() for d in found.values()}
    assert stamps == {cpu_cache.sources_stamp()}


def test_an_edit_to_any_kernel_source_changes_the_stamp(tmp_path, monkeypatch):
    for name in os.listdir(cpu_cache.KERNELS_DIR):
        if name.endswith(".py"):
            shutil.copy(os.path.join(cpu_cache.KERNELS_DIR, name), tmp_path / name)
    monkeypatch.setattr(cpu_cache, "KERNELS_DIR", str(tmp_path))
    before = cpu_cache.sources_stamp()
    assert cpu_cache.sources_stamp() == before                     # stable while nothing changes
    source = tmp_path / "cpu_dots.py"                              # a helper only other kernels inline
    text = source.read_text()
    source.write_text(text.replace("F32(0)", "F32(1)", 1))         # same size, other contents
    st = os.stat(source)
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert len(text) == len(source.read_text()) and cpu_cache.sources_stamp() != before
    (tmp_path / "notes.txt").write_text("not a source")
    source.write_text(text)
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000))
    assert cpu_cache.sources_stamp() == before                     # contents, not times, decide


def test_functions_elsewhere_keep_numbas_own_locators(tmp_path):
    assert cpu_cache.InTreeLocator.from_function(test_functions_elsewhere_keep_numbas_own_locators, __file__) is None
    assert os.path.dirname(kernels.__file__) == cpu_cache.KERNELS_DIR
