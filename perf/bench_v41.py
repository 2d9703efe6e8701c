"""DeepSeek-V4.1 on CPU: decoder-tail prefill speedup, and decode tok/s beside V4 at the same width.

  tail:   prefill time of one prompt through the engine (chunks of --chunk tokens), with
          `--decoder-tail exact` and `approx`, per prompt length; then --gen greedy tokens in
          both modes, reporting how many differ (random weights: the count says how far the
          approximation moves the output, not how good it is).
  decode: decode steps per second at batch 1 and 8 of the `small` V4.1 and V4 presets (the
          same width: hidden 256, 16 heads × 512), prompts of --prompt-len, --steps steps.

    python perf/bench_v41.py tail --lengths 4096 16384 32768 [--threads 1]
    python perf/bench_v41.py decode [--threads 1]

Random-weight checkpoints are written once under --work (default /tmp/ringserve-bench-v41).
The V4.1 model runs its fast kernels (Numerics(exact=False)); greedy tokens are compared
within that mode.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from ipc.messages import SamplingParams
from perf.machine import header, set_cpu_threads  # noqa: E402


def _model_dir(work: Path, arch: str) -> Path:
    from server.builtin import make_model_dir

    out = work / f"{arch}-small"
    if not (out / "config.json").exists():
        make_model_dir(out, "small", seed=0, arch=arch, quantize="fp8-fp4")
    return out


def _load(work: Path, arch: str, dspark: bool = False):
    from engine.models import registry
    from engine.weights import load_model

    model = load_model(_model_dir(work, arch), progress=False, load_mtp=dspark)
    if registry.of(model.cfg).capabilities.reference_numerics:  # V4.1: serve's fast numerics, not the reference's
        from engine.v41.numerics import Numerics

        model.numerics = Numerics(exact=False)
    return model


def _engine(model, max_len: int, chunk: int, seqs: int, **extra) -> Engine:
    blocks = seqs * (max_len // 256 + 2) + 4
    return Engine(model, EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=chunk, num_kv_blocks=blocks,
                                      block_size=256, speculative_tokens=0, max_model_len=max_len, **extra))


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


def _generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds until every request has its first token, greedy tokens)."""
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    t0, first, errors = time.perf_counter(), None, []
    while engine.has_work:
        out = engine.step()
        for d in out.deltas:
            tokens[d.request_id] += d.token_ids
        errors += [f"request {f.request_id}: {f.error}" for f in out.finished if f.error]
        if first is None and all(tokens.values()):
            first = time.perf_counter() - t0
    if errors or first is None:  # e.g. 'non-finite logits' (random weights can overflow)
        raise RuntimeError(f"generation failed: {errors or 'no first token'}")
    return first, [tokens[i] for i in range(len(prompts))]


def bench_tail(args) -> list[dict]:
    model = _load(args.work, "v41")
    rows = []
    for length in args.lengths:
        prompt = _prompts(1, length, model.cfg.vocab_size, seed=length)
        out = {}
        for mode in ("exact", "approx"):
            engine = _engine(model, length + args.gen + 8, args.chunk, 1, decoder_tail=mode)
            out[mode] = _generate(engine, prompt, args.gen)
        (t_exact, tok_exact), (t_approx, tok_approx) = out["exact"], out["approx"]
        differ = sum(a != b for a, b in zip(tok_exact[0], tok_approx[0]))
        first = next((i for i, (a, b) in enumerate(zip(tok_exact[0], tok_approx[0])) if a != b), None)
        row = {"length": length, "prefill_exact_s": round(t_exact, 3), "prefill_approx_s": round(t_approx, 3),
               "speedup_pct": round(100 * (t_exact / t_approx - 1), 1), "greedy_tokens": args.gen,
               "tokens_differing": differ, "first_difference": first}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def bench_decode(args) -> list[dict]:
    rows = []
    for arch in ("v41", "v4"):
        model = _load(args.work, arch)
        for batch in (1, 8):
            prompts = _prompts(batch, args.prompt_len, model.cfg.vocab_size, seed=batch)
            engine = _engine(model, args.prompt_len + args.steps + 8, 4096, batch)
            t_first, _ = _generate(engine, [prompts[0]], 3)  # warm-up: prefill and decode kernels compiled or loaded
            engine = _engine(model, args.prompt_len + args.steps + 8, 4096, batch)
            t0 = time.perf_counter()
            t_first, _ = _generate(engine, prompts, args.steps + 1)
            decode = time.perf_counter() - t0 - t_first
            row = {"arch": arch, "layers": model.cfg.num_layers, "batch": batch,
                   "decode_tok_s": round(batch * args.steps / decode, 2),
                   "step_ms_per_layer": round(1000 * decode / args.steps / model.cfg.num_layers, 2)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["tail", "decode"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ringserve-bench-v41"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    parser.add_argument("--gen", type=int, default=16, help="greedy tokens compared after the prefill")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    print(header("bench_v41"), flush=True)
    set_cpu_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    bench_tail(args) if args.what == "tail" else bench_decode(args)


if __name__ == "__main__":
    main()
