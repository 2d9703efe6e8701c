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


_THREE_KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]

# Tiny DeepSeek-V4 geometries for the peer sweep (perf/compare_peer.py --geometries): preset
# `small` plus these overrides, (layers, weights). They span hidden 128-1024, heads 4-32 ×
# head_dim 64-512, index top-k 4-512, experts 8-128 (top-2..8), vocab 1k-32k. Weights
# "fp8-fp4": FP8 projections, MXFP4 routed experts (the release's formats); "bf16": bf16
# projections with MXFP4 routed experts (llama.cpp's converter takes DeepSeek-V4 experts in MXFP4
# only).
GEOMETRIES: dict[str, tuple[dict, int, str]] = {
    # the `small` preset's attention (16 × 512, index 64 × 128 top-512): the README's checkpoint
    "small6": ({}, 6, "fp8-fp4"),
    # issue 41's: small heads, an index that picks 4 entries, a 1k vocabulary
    "issue41": (dict(hidden_size=256, num_attention_heads=8, head_dim=128, qk_rope_head_dim=64, index_n_heads=4,
                     index_head_dim=64, index_topk=4, vocab_size=1000), 6, "fp8-fp4"),
    # narrow and bf16: 4 × 64 heads, 8 experts top-2, a 32k vocabulary (the LM head dominates)
    "narrow-bf16": (dict(hidden_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=32, q_lora_rank=128,
                         o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=32, index_topk=16,
                         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, vocab_size=32000),
                    6, "bf16"),
    # wide: hidden 1024, 32 × 64 heads, 128 experts top-8
    "wide-fp8": (dict(hidden_size=1024, num_attention_heads=32, head_dim=64, qk_rope_head_dim=32, q_lora_rank=512,
                      o_groups=8, o_lora_rank=256, index_n_heads=8, index_head_dim=64, index_topk=64,
                      n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=128, vocab_size=16384),
                 4, "fp8-fp4"),
    # mid-size and bf16: 16 × 256 heads, 32 experts top-4
    "mid-bf16": (dict(hidden_size=512, num_attention_heads=16, head_dim=256, qk_rope_head_dim=64, q_lora_rank=384,
                      o_groups=4, o_lora_rank=256, index_n_heads=16, index_head_dim=128, index_topk=128,
                      n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, vocab_size=4096),
                 6, "bf16"),
    # 12 × 128 heads, 16 experts top-2, FP8/FP4
    "deep-fp8": (dict(hidden_size=768, num_attention_heads=12, head_dim=128, qk_rope_head_dim=64, q_lora_rank=384,
                      o_groups=4, o_lora_rank=256, index_n_heads=8, index_head_dim=64, index_topk=32,
                      n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=256, vocab_size=2048),
                 8, "fp8-fp4"),
    # Three more, first run after the six above were tuned (2026-12-06), kept for the sweep:
    # a 32k vocabulary on hidden 512 (the bf16 LM head is ~80 % of a token's weight bytes)
    "vocab32k-fp8": (dict(hidden_size=512, num_attention_heads=8, head_dim=128, qk_rope_head_dim=64, q_lora_rank=256,
                          o_groups=4, o_lora_rank=128, index_n_heads=4, index_head_dim=64, index_topk=32,
                          n_routed_experts=64, num_experts_per_tok=4, moe_intermediate_size=256, vocab_size=32000),
                     4, "fp8-fp4"),
    # 6 × 256 heads, index top-k 256, 32 narrow experts top-8, bf16
    "idx256-bf16": (dict(hidden_size=384, num_attention_heads=6, head_dim=256, qk_rope_head_dim=64, q_lora_rank=192,
                         o_groups=2, o_lora_rank=192, index_n_heads=8, index_head_dim=64, index_topk=256,
                         n_routed_experts=32, num_experts_per_tok=8, moe_intermediate_size=64, vocab_size=8000),
                    5, "bf16"),
    # hidden 1024 over 3 layers, 16 × 128 heads, 96 experts top-6 of 256, a 24k vocabulary
    "wide96-fp8": (dict(hidden_size=1024, num_attention_heads=16, head_dim=128, qk_rope_head_dim=64, q_lora_rank=768,
                        o_groups=8, o_lora_rank=512, index_n_heads=16, index_head_dim=64, index_topk=128,
                        n_routed_experts=96, num_experts_per_tok=6, moe_intermediate_size=256, vocab_size=24000),
                   3, "fp8-fp4"),
}


def make_model(out_dir: Path, seed: int = 0, geometry: str = "small6") -> Path:
    """A tiny DeepSeek-V4 of `geometry` (GEOMETRIES) in the upstream layout, with a tokenizer:
    FP8 projections and FP4 experts, or bf16 weights, as the geometry says. The default is the
    `small` preset at 6 layers (hidden 256, 64 experts top-6, head_dim 512, window 128)."""
    import torch

    sys.path.insert(0, str(REPO))
    from engine.v4.checkpoint import preset_config, random_state, write_checkpoint
    from tokenization.synthetic_bpe import write_tokenizer

    if geometry not in GEOMETRIES:
        raise PeerBuildError(f"unknown geometry {geometry!r}; choose from {', '.join(GEOMETRIES)}")
    overrides, layers, weights = GEOMETRIES[geometry]
    kinds = (_THREE_KINDS * layers)[:layers]
    cfg = preset_config("small", num_hidden_layers=layers, layer_types=kinds,
                        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1), **overrides)
    out = write_checkpoint(out_dir, cfg, random_state(cfg, seed), layout="upstream", dtype=torch.bfloat16,
                           quantize="fp8-fp4")
    if weights == "bf16":
        _fp8_projections_to_bf16(out)
    write_tokenizer(out, cfg.vocab_size)
    return out


def _fp8_projections_to_bf16(model_dir: Path) -> None:
    """Store every FP8 projection of a checkpoint as bf16 (its exact decoded values: e4m3 times a
    power-of-two scale fits bf16) without its scale; the MXFP4 experts stay."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    block = json.loads((model_dir / "config.json").read_text())["quantization_config"]["weight_block_size"]
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(shard)
        for name in [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]:
            scale = tensors.pop(name.removesuffix(".weight") + ".scale").float()
            n, k = tensors[name].shape
            full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
            tensors[name] = (tensors[name].float() * full).to(torch.bfloat16)
            if index is not None:
                index["weight_map"].pop(name.removesuffix(".weight") + ".scale", None)
        save_file(tensors, shard, metadata={"format": "pt"})
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model", help="write a tiny V4 checkpoint (default: the 6-layer FP8/FP4 small6)")
    mk.add_argument("out_dir")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--geometry", choices=list(GEOMETRIES), default="small6")
    b = sub.add_parser("build", help="fetch the sdist and build llama-server; prints its path")
    b.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    b.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "make-model":
            print(make_model(Path(a.out_dir), a.seed, a.geometry))
        else:
            print(build_server(Path(a.cache_dir), a.jobs))
    except PeerBuildError as exc:
        print(f"peer_llamacpp: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
