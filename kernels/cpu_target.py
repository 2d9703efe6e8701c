"""The vector width numba compiles the CPU kernels for.

LLVM tunes Intel's AVX-512 server cores (Skylake-SP to Emerald Rapids) to prefer 256-bit vectors
(the `prefer-256-bit` tuning feature), so numba's loops on such a CPU use ymm registers and half
of what its vector units can do per instruction. The decode-step kernels are instruction-bound
(weight decode, then the dot products), and on a 2-core Xeon (Emerald Rapids, one thread,
perf/bench_weight_decode.py) 512-bit vectors took the FP8 row kernel from 0.34 to 0.22 cycles a
weight and the MXFP4 one from 0.65 to 0.37, and wide-fp8's batch-1 decode step (one thread,
medians of three alternating processes, perf/bench_cpu_decode.py) from 11.7 to 9.5 ms. Zen 4
runs 512-bit instructions as two 256-bit halves, so it gains fewer instructions, not wider
units (not measured there). So on a CPU with AVX-512F the kernels are compiled
for the host's features plus `-prefer-256-bit` (`configure`), unless the operator set
NUMBA_CPU_FEATURES or NUMBA_CPU_NAME (kept as given; `NUMBA_CPU_FEATURES=$(python -c "import
llvmlite.binding as b; print(b.get_host_cpu_features().flatten())")` restores LLVM's choice).
CPUs without AVX-512 are left as they are.

The setting goes into the environment (so workers, `ringserve warm-kernels` and the tests build
and read the same numba cache: its index keys on the features) and into numba's config, which
numba reads when it first compiles or loads a function; `kernels/__init__.py` calls `configure`
before it imports any kernel. Sums vectorised at another width associate differently, so fp32
results can differ from a 256-bit build in the last bits (every kernel test compares with a
tolerance against its reference, or two paths of the same build bit for bit).
"""

from __future__ import annotations

import os
import sys

FEATURES_ENV = "NUMBA_CPU_FEATURES"
NAME_ENV = "NUMBA_CPU_NAME"
WIDE_VECTORS = "-prefer-256-bit"


def wide_vector_features(host_features: str) -> str | None:
    """The feature string with 512-bit vectors preferred, for a host with AVX-512F; else None."""
    if "+avx512f" not in host_features.split(","):
        return None
    return f"{host_features},{WIDE_VECTORS}"


def configure() -> str | None:
    """Set NUMBA_CPU_FEATURES (environment and numba's config) to the host's features with
    512-bit vectors preferred, where the host has AVX-512F and the operator set neither
    NUMBA_CPU_FEATURES nor NUMBA_CPU_NAME. Returns the features now in effect from this
    module's choice, or None where it left numba's default."""
    if os.environ.get(NAME_ENV):
        return None
    chosen = os.environ.get(FEATURES_ENV)
    if chosen is None:
        import llvmlite.binding as llvm

        try:
            host = llvm.get_host_cpu_features().flatten()
        except RuntimeError:                                # LLVM cannot read this host's features
            return None
        chosen = wide_vector_features(host)
        if chosen is None:
            return None
        os.environ[FEATURES_ENV] = chosen
    elif WIDE_VECTORS not in chosen.split(","):
        return None                                         # the operator's own features
    numba = sys.modules.get("numba")
    if numba is not None:                                   # imported already: numba reads its config
        numba.config.CPU_FEATURES = chosen                  # at its first compile or cache load
    return chosen
