"""The built-in model: the trained one shipped in server/builtin_model/ when it is there, else
the `small` preset with random weights (seed 0), generated once into a cache dir.

The trained model is a small DeepSeek-V4 with its MTP layer, trained on the Python
documentation by train/ (`ringserve train-builtin server/builtin_model`; its recipe.json records
the command, seed, corpus and losses). It is read in place.

The random one is generated rather than shipped so the repository stays small; generation is
deterministic, so every machine gets identical weights. It runs in a child process
(`python -m server.builtin`), so that the caller, e.g. the HTTP server, never loads torch. The
directory is built under a temporary name and renamed into place, so a crash mid-write never
leaves a half-written model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BUILTIN_NAME = "builtin-v4-small-seed0-v1"
TRAINED_DIR = Path(__file__).resolve().parent / "builtin_model"


def cache_root() -> Path:
    root = os.environ.get("RINGSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ringserve")
    return Path(root)


def make_model_dir(out_dir: str | Path, preset: str, seed: int = 0, layout: str = "upstream", dtype: str = "bf16",
                   quantize: str | None = None, arch: str = "v4", **overrides) -> Path:
    """Write a random-weight checkpoint plus tokenizer (what `ringserve make-model` does) through
    the architecture `arch` names (engine/models/ `write_checkpoint`): V4 takes preset field
    overrides; 'v41' writes a DeepSeek-V4.1 release-format directory (its own layout and dtypes),
    whose only override is `vision=True` (the preset's vision tower). ValueError names an option
    the architecture does not take."""
    from engine.models import registry

    vision = bool(overrides.pop("vision", False))
    return registry.get(arch).write_checkpoint(out_dir, preset, seed=seed, quantize=quantize, layout=layout,
                                               dtype=dtype, vision=vision, **overrides)


def trained_model_dir() -> Path | None:
    """The shipped trained model's directory, None when this checkout has none."""
    if all((TRAINED_DIR / name).exists() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        return TRAINED_DIR
    return None


def builtin_model_dir() -> Path:
    trained = trained_model_dir()
    if trained is not None:
        return trained
    target = cache_root() / BUILTIN_NAME
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=BUILTIN_NAME + ".", dir=target.parent))
    try:
        subprocess.run([sys.executable, "-m", "server.builtin", str(staging)], check=True)
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


if __name__ == "__main__":
    make_model_dir(sys.argv[1], "small")
