"""Load ``kernels/cuda/<name>.cu`` as a CuPy RawModule (NVRTC), cached per (name, defines, names).

The source gets the ``#define`` lines, then ``#line 1 "<path>"`` so compiler errors point at
the real file. CUDA headers (cuda_fp8.h, cuda_fp4.h, ...) come from the toolkit or wheel whose
CUDA major version matches NVRTC's (`cuda_include_dirs`): CUDA 13 on the GPU image
(cupy-cuda13x), CUDA 12 where cupy-cuda12x is installed.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
BASE_OPTIONS = ("-std=c++17",)


def cuda_sources() -> list[Path]:
    """Every .cu file of the package."""
    return sorted(CUDA_DIR.glob("*.cu"))


def _header_candidates() -> list[Path]:
    """Include dirs that may hold the CUDA headers, in the order they are preferred: the toolkit
    named by $CUDA_PATH / $CUDA_HOME, the pip wheels (CUDA 13's nvidia/cu13 layout, CUDA 12's
    nvidia-cuda-runtime-cu12), the toolkit of the nvcc on PATH, /usr/local/cuda, Triton's copy."""
    dirs = [Path(os.environ[v]) / "include" for v in ("CUDA_PATH", "CUDA_HOME") if os.environ.get(v)]
    nvidia = importlib.util.find_spec("nvidia")
    for root in (nvidia.submodule_search_locations if nvidia and nvidia.submodule_search_locations else []):
        dirs += [Path(root) / "cu13" / "include", Path(root) / "cuda_runtime" / "include"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        dirs.append(Path(nvcc).resolve().parent.parent / "include")
    dirs.append(Path("/usr/local/cuda/include"))
    triton = importlib.util.find_spec("triton")
    if triton and triton.submodule_search_locations:  # Triton bundles the headers of its ptxas
        dirs += [Path(p) / "backends" / "nvidia" / "include" for p in triton.submodule_search_locations]
    return dirs


def header_major(include: Path) -> int | None:
    """The CUDA major version of the headers in `include` (CUDART_VERSION), None if unreadable."""
    try:
        match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", (include / "cuda_runtime_api.h").read_text())
    except OSError:
        return None
    return int(match.group(1)) // 1000 if match else None


def nvrtc_major() -> int | None:
    """The major version of the NVRTC CuPy compiles with, None without CuPy."""
    try:
        import cupy.cuda

        return cupy.cuda.nvrtc.getVersion()[0]
    except Exception:  # noqa: BLE001 - no CuPy or no NVRTC library: nothing to match
        return None


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """The include dir holding cuda_fp8.h / cuda_fp4.h for the kernel compiles: of those found
    (see _header_candidates), the first whose CUDA major version is NVRTC's (CUDA 13 headers for
    cupy-cuda13x, 12 for cupy-cuda12x: NVRTC rejects a newer major's headers), else the first."""
    found = [d for d in _header_candidates() if (d / "cuda_fp4.h").is_file()]
    major = nvrtc_major()
    matching = [d for d in found if major is not None and header_major(d) == major]
    chosen = (matching or found)[:1]
    return tuple(str(d) for d in chosen)


def source_text(path: Path, defines: tuple[tuple[str, int | str], ...] = ()) -> str:
    """The text compiled for ``path``: defines, a #line directive, then the file."""
    lines = [f"#define {key} {value}" for key, value in defines]
    lines.append(f'#line 1 "{path}"')
    return "\n".join(lines) + "\n" + path.read_text()


def compile_options() -> tuple[str, ...]:
    return BASE_OPTIONS + tuple(f"-I{d}" for d in cuda_include_dirs())


@functools.cache
def load_module(name: str, defines: tuple[tuple[str, int | str], ...] = (),
                name_expressions: tuple[str, ...] = ()):
    """A ``cupy.RawModule`` for ``cuda/<name>.cu``; compiled on first use, then cached."""
    import cupy

    path = CUDA_DIR / f"{name}.cu"
    return cupy.RawModule(code=source_text(path, defines), options=compile_options(),
                          name_expressions=name_expressions or None, backend="nvrtc")


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - any CuPy/driver failure means "no usable GPU"
        return False
