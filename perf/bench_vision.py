"""DeepSeek-V4.1 images on CPU: what an image costs beside the text around it, side by side in one run.

Per image size (a gradient-with-noise PNG), medians over --rounds (the variants interleave within
each round, so a busy neighbour slows them alike; one warm-up round first):
  preprocess   VisionFrontend.preprocess: PNG decode, DeepSeek's resize plan and Pillow resize /
               letterbox, SHA-256 digest (the HTTP front's share)
  encode       the tower on those pixels: patches, ViT, aligner, span rows (ImageEncoder.span_rows,
               no encoder cache)
  ttft text    TTFT of --text-len text tokens
  ttft +span   TTFT of the same text with as many text tokens as the image's span holds in the
               image's place: the prompt with the image, minus the image's own work
  ttft image   TTFT of the same text with the image in the middle (the encoder runs inside the
               step; preprocessing not included, it happens at the edge)
Derived: span prefill = ttft +span − ttft text (the backbone's cost of the span's positions);
(preprocess + encode) / span prefill; ttft image / ttft text; and ttft image − ttft +span,
the image's overhead inside the engine, beside encode. Each TTFT is a fresh engine (prefix
caching off, so no cache hides any work).

The model is a random-weight checkpoint in the release format (`write_v41_checkpoint`, text
preset --preset, vision tower VISION_PRESETS[--preset]: for `small` a ViT of 4 layers x 128,
patch 14, downsample 3, 256-token image budget) with the fast kernels (Numerics(exact=False)).
The release's tower is wider and deeper; these are ratios at bench geometry.

    python perf/bench_vision.py [--sizes 224x224 640x480 1280x960] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from engine.config import EngineConfig
from engine.engine import Engine
from engine.v41.checkpoint import write_v41_checkpoint
from engine.v41.numerics import Numerics
from engine.v41.vision.frontend import VisionFrontend
from engine.v41.vision.inputs import check_request_images
from engine.weights import load_model
from ipc.messages import SamplingParams
from perf.machine import header, set_cpu_threads


def _model_dir(work: Path, preset: str) -> Path:
    out = work / f"v41-{preset}-vision"
    if not (out / "config.json").exists():
        write_v41_checkpoint(out, preset, seed=0, quantize="fp8-fp4", vision=True)
    return out


def _png(width: int, height: int, seed: int) -> bytes:
    """A smooth gradient with noise: compresses like a photo more than pure noise does."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def _ttft(model, ids: list[int], images=()) -> float:
    """Seconds from add_request to the first token, on a fresh engine."""
    engine = Engine(model, EngineConfig(max_num_seqs=1, max_num_batched_tokens=4096, num_kv_blocks=16,
                                        block_size=256, speculative_tokens=0, max_model_len=2048,
                                        enable_prefix_caching=False))
    t0 = time.perf_counter()
    engine.add_request(0, ids, SamplingParams(max_tokens=1, ignore_eos=True), images=list(images))
    while engine.has_work:
        out = engine.step()
        if out.deltas:
            return time.perf_counter() - t0
    raise RuntimeError(f"no first token: {[f.error for f in out.finished]}")


def bench(args) -> list[dict]:
    model_dir = _model_dir(args.work, args.preset)
    model = load_model(model_dir, progress=False, load_mtp=False)
    model.numerics = Numerics(exact=False)
    frontend = VisionFrontend.from_model_dir(model_dir)
    vision = frontend.vision
    print(f"# model: {model_dir.name}: {model.cfg.num_layers} layers x {model.cfg.hidden_size}; ViT {vision.n_layers} "
          f"layers x {vision.dim}, patch {vision.patch_size}, downsample {vision.downsample_ratio}, budget "
          f"{vision.max_n_token} tokens; {args.text_len} text tokens; medians of {args.rounds} rounds", flush=True)
    rng = np.random.default_rng(0)
    text = rng.integers(3, model.cfg.vocab_size - 2, args.text_len).tolist()
    half = args.text_len // 2
    rows = []
    for size in args.sizes:
        width, height = (int(v) for v in size.split("x"))
        data = _png(width, height, seed=width * height)
        image = frontend.preprocess(data)
        ids, starts = frontend.expand_placeholders(text[:half] + [frontend.image_token_id] + text[half:], [image])
        wire = frontend.image_data([image], starts)
        span = check_request_images(wire, ids, vision, frontend.image_token_id).images[0]
        filler = rng.integers(3, model.cfg.vocab_size - 2, span.length).tolist()
        text_span = text[:half] + filler + text[half:]
        runs = {
            "preprocess": lambda: frontend.preprocess(data),
            "encode": lambda: model.encoder.span_rows(span),
            "ttft_text": lambda: _ttft(model, text),
            "ttft_text_span": lambda: _ttft(model, text_span),
            "ttft_image": lambda: _ttft(model, ids, wire),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for rnd in range(args.rounds + 1):  # round 0 warms up
            for name, fn in runs.items():
                t0 = time.perf_counter()
                value = fn()
                took = value if name.startswith("ttft") else time.perf_counter() - t0
                if rnd:
                    times[name].append(took)
        ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
        span_prefill = ms["ttft_text_span"] - ms["ttft_text"]
        row = {"image": f"{width}x{height}", "fed": f"{image.n_vit_w * vision.patch_size}x"
               f"{image.n_vit_h * vision.patch_size}", "span_tokens": span.length,
               **{f"{k}_ms": round(v, 2) for k, v in ms.items()}, "span_prefill_ms": round(span_prefill, 2),
               "(preprocess+encode)/span_prefill": round((ms["preprocess"] + ms["encode"]) / span_prefill, 3),
               "ttft_image/ttft_text": round(ms["ttft_image"] / ms["ttft_text"], 2),
               "image_overhead_ms": round(ms["ttft_image"] - ms["ttft_text_span"], 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ringserve-bench-vision"))
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--sizes", nargs="+", default=["224x224", "640x480", "1280x960"])
    parser.add_argument("--text-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(header("bench_vision"), flush=True)
    set_cpu_threads(args.threads)
    torch.manual_seed(0)
    args.work.mkdir(parents=True, exist_ok=True)
    bench(args)


if __name__ == "__main__":
    main()
