"""`ringserve warm-kernels`: compile the CPU kernels into numba's on-disk cache ahead of serving.

The CPU kernels (kernels/cpu_*.py) are numba functions compiled on first call for the argument
types they see and cached next to their source (`cache=True`). On a fresh install the first
`ringserve serve` would otherwise spend ~45 s of a 2-core machine in the compiler before its
first token, once in every data-parallel worker at the same time. scripts/setup.sh runs this
command, so that cost is paid once, at install time.

It serves a short batch through the real worker process (`server.llm.LLM`, the serve
configuration), so it compiles exactly what serving compiles: by default for the built-in model
and for tiny random V4 and V4.1 checkpoints in the release format (FP8 projections, FP4 experts),
whose kernels the built-in model (bf16) does not use, the V4 one also with the quantized KV
records of `--kv-dtype fp8` and `fp4` (the default on CPU keeps KV in the compute dtype). A
cache that is already warm makes this a few seconds per model; a cache from another CPU or another source version is recompiled by numba
itself (its index keys on both).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

# Two prompts of different lengths: a batch of two in prefill and decode, and a prompt longer
# than one decode row, so both the row kernels and the tiled GEMM paths are compiled.
PROMPTS = [list(range(3, 40)), [5, 6, 7]]
MAX_TOKENS = 6


# The tiny preset with the released head geometry the quantized KV records need (a 64-dim rope
# part kept in bf16, 448 + 64 of a 512-dim head in the release; 64 + 64 here).
QUANTIZABLE_KV = dict(head_dim=128, qk_rope_head_dim=64, index_head_dim=64)


def release_format_dirs(root: Path) -> tuple[Path, Path]:
    """Tiny random V4 and V4.1 checkpoints in the release format, written under root."""
    from server.builtin import make_model_dir

    return (make_model_dir(root / "v4-fp8-fp4", "tiny", quantize="fp8-fp4", **QUANTIZABLE_KV),
            make_model_dir(root / "v41-fp8-fp4", "tiny", quantize="fp8-fp4", arch="v41"))


def warm(model_dir: Path, **engine_args) -> float:
    """Serve PROMPTS on model_dir through one CPU worker (EngineConfig fields as for LLM); the
    seconds it took."""
    from ipc.messages import SamplingParams
    from server.llm import LLM

    t0 = time.monotonic()
    llm = LLM(model_dir, device="cpu", **engine_args)
    try:
        results = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        llm.close()
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{model_dir}: warm-up generation failed: {errors[0]}")
    return time.monotonic() - t0


def warm_all(model_dirs: list[Path] | None = None) -> list[tuple[str, float]]:
    """Warm each directory (default: the built-in model and the release formats); (what was
    warmed, seconds) each."""
    if model_dirs:
        return [(str(d), warm(d)) for d in model_dirs]
    from server.builtin import builtin_model_dir

    builtin = builtin_model_dir()  # the untrained fallback is written on first call
    done = [(str(builtin), warm(builtin))]
    with tempfile.TemporaryDirectory(prefix="ringserve-warm-") as tmp:
        v4, v41 = release_format_dirs(Path(tmp))
        for kv in ("auto", "fp8", "fp4"):
            done.append((f"the V4 release format, --kv-dtype {kv}", warm(v4, kv_dtype=kv)))
        done.append(("the V4.1 release format", warm(v41)))
    return done
