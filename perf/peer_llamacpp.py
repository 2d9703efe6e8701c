"""llama.cpp's `llama-server` as a benchmark peer: fetched, built and fed a GGUF at benchmark time.

Used by perf/compare_peer.py (`--peer llama.cpp`); never a runtime dependency of ringserve. Steps,
each cached under `--cache-dir` (default `<repo>/.peer-cache`, git-ignored) and skipped when its
output exists:

1. `pip download llama-cpp-python==VERSION --no-binary :all: --no-deps`: the sdist vendors a
   llama.cpp tree (build b11312 for 0.3.36, which has DeepSeek-V4 support) and its converter.
2. CMake + Ninja build of the `llama-server` target only (CPU backend, no curl/OpenSSL, no tests).
3. llama.cpp's own `convert_hf_to_gguf.py` (through perf/peer_gguf_convert.py) on the ringserve
   checkpoint, which must be in the upstream layout with `--quantize fp8-fp4`: the converter reads
   the released tensor names, keeps the FP4 experts as MXFP4 and turns FP8 projections into Q8_0.
4. `llama-server -m MODEL.gguf` with one slot per concurrent request (continuous batching).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SDIST_VERSION = "0.3.36"
DEFAULT_CACHE = REPO / ".peer-cache"

# Off everything the server does not need; shared libs as llama.cpp builds them by default.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_CCACHE=OFF")


class PeerBuildError(Exception):
    pass


def sdist_dir(cache: Path, version: str = SDIST_VERSION) -> Path:
    return cache / f"llama_cpp_python-{version}"


def llama_src(cache: Path, version: str = SDIST_VERSION) -> Path:
    """The llama.cpp tree vendored in the sdist."""
    return sdist_dir(cache, version) / "vendor" / "llama.cpp"


def server_binary(build_dir: Path) -> Path:
    return build_dir / "bin" / "llama-server"


def _run(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> None:
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        raise PeerBuildError(f"{what} failed with status {r.returncode}; see {log}")


def fetch_sdist(cache: Path, version: str = SDIST_VERSION) -> Path:
    """Download and unpack the llama-cpp-python sdist unless its llama.cpp tree is there."""
    src = llama_src(cache, version)
    if (src / "CMakeLists.txt").exists():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    dl = cache / "sdist"
    _run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
          "--no-deps", "-d", str(dl)], cache / "fetch.log", "pip download")
    archives = sorted(dl.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not archives:
        raise PeerBuildError(f"pip download left no llama_cpp_python-{version}.tar.gz in {dl}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(cache, filter="data")
    if not (src / "CMakeLists.txt").exists():
        raise PeerBuildError(f"the sdist has no vendored llama.cpp at {src}")
    return src


def cmake_command(src: Path, build_dir: Path) -> list[str]:
    return ["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja", *CMAKE_FLAGS]


def ninja_command(build_dir: Path, jobs: int) -> list[str]:
    return ["nice", "-n", "5", "ninja", "-C", str(build_dir), f"-j{jobs}", "llama-server"]


def build_server(cache: Path, jobs: int = 2, version: str = SDIST_VERSION) -> Path:
    """Path of a built `llama-server`; configures and builds only that target when needed.

    Ninja is always run (a no-op when up to date), so an interrupted build resumes."""
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise PeerBuildError(f"`{tool}` is not on PATH; it is needed to build llama-server")
    src = fetch_sdist(cache, version)
    build = cache / "llama-build"
    if not (build / "build.ninja").exists():
        _run(cmake_command(src, build), cache / "cmake.log", "cmake configure")
    _run(ninja_command(build, jobs), cache / "build.log", "ninja llama-server")
    binary = server_binary(build)
    if not binary.exists():
        raise PeerBuildError(f"the build finished without {binary}")
    return binary


def convert_command(src: Path, model_dir: Path, out: Path) -> list[str]:
    return [sys.executable, str(REPO / "perf" / "peer_gguf_convert.py"), str(src), "--",
            str(model_dir), "--outfile", str(out)]


def _model_key(model_dir: Path) -> str:
    """Digest of config.json and the shard names/sizes: a re-made checkpoint gets a new GGUF."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def convert_model(cache: Path, model_dir: Path, version: str = SDIST_VERSION) -> Path:
    """GGUF of `model_dir` made by llama.cpp's converter (cached by `_model_key`)."""
    model_dir = Path(model_dir).resolve()
    out = cache / "gguf" / f"{model_dir.name}-{_model_key(model_dir)}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    _run(convert_command(fetch_sdist(cache, version), model_dir, part), cache / "convert.log",
         "convert_hf_to_gguf.py", env={**os.environ, "PYTHONPATH": ""})
    part.rename(out)
    return out


def server_command(binary: Path, gguf: Path, port: int, threads: int, slots: int, ctx_per_slot: int,
                   name: str) -> list[str]:
    """llama-server with `slots` parallel sequences of `ctx_per_slot` tokens each.

    llama.cpp splits `--ctx-size` evenly over `--parallel` slots; continuous batching is on, so
    concurrent requests decode in one batch as in ringserve. `--no-repack`: with the CPU repacked
    weight buffers (the default) build b11312 aborts on this DeepSeek-V4 GGUF while reserving its
    graph (`GGML_ASSERT(*cur_backend_id != -1)` in ggml_backend_sched_split_graph)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(slots),
            "--ctx-size", str(slots * ctx_per_slot), "--cont-batching", "--no-repack", "--no-webui",
            "--alias", name]


def make_model(out_dir: Path, seed: int = 0) -> Path:
    """The issue's tiny DeepSeek-V4 for this comparison: the `small` preset at 6 layers (hidden 256,
    64 experts top-6, head_dim 512, window 128), upstream layout, FP8 projections, FP4 experts."""
    import torch

    sys.path.insert(0, str(REPO))
    from engine.checkpoint import preset_config, random_state, write_checkpoint
    from server.make_tokenizer import write_tokenizer

    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * 2
    cfg = preset_config("small", num_hidden_layers=6, layer_types=kinds, mlp_layer_types=["hash_moe"] + ["moe"] * 5)
    out = write_checkpoint(out_dir, cfg, random_state(cfg, seed), layout="upstream", dtype=torch.bfloat16,
                           quantize="fp8-fp4")
    write_tokenizer(out, cfg.vocab_size)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model", help="write the 6-layer FP8/FP4 tiny V4 checkpoint")
    mk.add_argument("out_dir")
    mk.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("build", help="fetch the sdist and build llama-server; prints its path")
    b.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    b.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "make-model":
            print(make_model(Path(a.out_dir), a.seed))
        else:
            print(build_server(Path(a.cache_dir), a.jobs))
    except PeerBuildError as exc:
        print(f"peer_llamacpp: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
