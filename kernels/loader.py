"""Load ``kernels/cuda/<name>.cu`` as a CuPy RawModule (NVRTC), cached per (name, defines, names).

The source gets the ``#define`` lines, then ``#line 1 "<path>"`` so compiler errors point at
the real file. CUDA headers (cuda_fp8.h, cuda_fp4.h, ...) come from the installed
``nvidia-cuda-runtime-cu12`` wheel when present.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
BASE_OPTIONS = ("-std=c++17",)


def cuda_sources() -> list[Path]:
    """Every .cu file of the package."""
    return sorted(CUDA_DIR.glob("*.cu"))


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """Include dirs holding cuda_fp8.h / cuda_fp4.h, from the nvidia-cuda-runtime-cu12 wheel."""
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is None or not spec.submodule_search_locations:
        return ()
    dirs = [Path(p) / "include" for p in spec.submodule_search_locations]
    return tuple(str(d) for d in dirs if (d / "cuda_fp4.h").is_file())


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
