"""MTP speculation on a real model (default: the built-in) at batch 1: acceptance and tokens/s.

perf/bench_spec.py measures the mechanism on random weights, whose drafts fail; this runs the
same measurement (its `run`) on a trained checkpoint and a text prompt, for each k, with all k
drafts verified every step ('fixed', so per-position acceptance is measured at every depth) and
with load-adaptive speculation (the default). Per-position acceptance i is the fraction of
verify steps whose first i drafts were all accepted.

    python perf/bench_spec_model.py [--model-dir DIR] [--k 1 2 3] [--tokens 128] [--prompt-file F]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.weights import load_model  # noqa: E402
from perf.bench_spec import run  # noqa: E402
from server.builtin import builtin_model_dir  # noqa: E402
from server.tokenizer import Tokenizer  # noqa: E402

_DEFAULT_PROMPT = Path(__file__).resolve().parents[1] / "tests" / "data" / "builtin" / "heldout_sample.txt"


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-file", default=str(_DEFAULT_PROMPT), help="text whose first --prompt-tokens tokens prompt")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir) if args.model_dir else builtin_model_dir()
    model = load_model(model_dir, dtype=torch.float32, progress=False)
    prompt = Tokenizer.from_dir(model_dir).encode(Path(args.prompt_file).read_text())[: args.prompt_tokens]
    base, tps0, _, _ = run(model, 0, prompt, args.tokens)
    rows = [("off", tps0, 1.0, [])]
    for k in args.k:
        for adaptive in (False, True):
            out, tps, length, per_pos = run(model, k, prompt, args.tokens, adaptive=adaptive)
            assert out == base, "speculation changed greedy output"
            rows.append((f"MTP k={k} {'adaptive' if adaptive else 'fixed'}", tps, length, per_pos))
    print(f"{model_dir.name}, batch 1, {args.tokens} greedy tokens after a {len(prompt)}-token prompt, fp32, "
          f"{args.threads} thread(s)")
    print(f"{'speculation':20} {'tok/s':>8} {'vs off':>7} {'accept len':>11}  per-position acceptance")
    for name, t, length, pos in rows:
        print(f"{name:20} {t:8.2f} {t / tps0:6.2f}x {length:11.2f}  {' '.join(f'{p:.2f}' for p in pos)}")


if __name__ == "__main__":
    main()
