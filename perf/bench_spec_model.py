"""MTP speculation on a real model (default: the built-in): acceptance and tokens/s at batch 1 and 8.

A DeepSeek-V4.1 directory (e.g. `ringserve train-builtin DIR --arch v41`) is measured the same
way with its DSpark drafter in place of the MTP layer (k at most its block size; V4.1 computes
in its own bf16 numerics whatever the dtype). `--v41-numerics` picks the engine's mode:
row-independent (default here: decode and verification then agree bit for bit, so greedy output
cannot change) or reference (what serving uses: a verified chunk's fp32 GEMMs see more rows than
a decode's, so a near-tie can resolve differently and the check below may fail).

perf/bench_spec.py measures the mechanism on random weights, whose drafts fail; this runs the
measurement on a trained checkpoint and text prompts (consecutive windows of a held-out text),
for each k, with all k drafts verified every step ('fixed', so per-position acceptance is
measured at every depth) and with load-adaptive speculation (the default), whose choice is
reported as the mean number of drafts it verified per step. Per-position acceptance i is the
fraction of verify steps whose first i drafts were all accepted. Greedy output must not change.

    python perf/bench_spec_model.py [--model-dir DIR] [--k 1 2 3] [--batch 1 8] [--tokens 128] [--repeats 3]

Each configuration runs --repeats times, the configurations of a batch size taking turns (off,
k=1 fixed, k=1 adaptive, ..., then again), and tok/s is the median of its runs: a shared machine's
load swings between rows, and interleaving spreads it over all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.models import registry  # noqa: E402
from engine.weights import load_model  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from server.builtin import builtin_model_dir  # noqa: E402
from server.tokenizer import Tokenizer  # noqa: E402
from perf.machine import header, set_cpu_threads  # noqa: E402

_DEFAULT_PROMPT = Path(__file__).resolve().parents[1] / "tests" / "data" / "builtin" / "heldout_sample.txt"


@dataclass
class Row:
    outputs: list[list[int]]
    tok_s: float  # generated tokens per second over the timed (post-prefill) steps, whole batch
    accept_len: float  # 1 + accepted drafts per verify step
    per_position: list[float]
    drafts_per_step: float  # mean drafts verified per verify step (what adaptive speculation chose)


def run(model, k: int, prompts: list[list[int]], tokens: int, adaptive: bool) -> Row:
    engine = Engine(model, EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=4096, speculative_tokens=k,
                                        kv_cache_memory_bytes=256 << 20, adaptive_speculation=adaptive))
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_tokens=tokens, ignore_eos=True))
    out: list[list[int]] = [[] for _ in prompts]
    first = 0
    while engine.has_work and first < len(prompts):  # prefills and first tokens, not timed
        for d in engine.step().deltas:
            first += not out[d.request_id]
            out[d.request_id].extend(d.token_ids)
    done = sum(map(len, out))
    t0 = time.perf_counter()
    while engine.has_work:
        for d in engine.step().deltas:
            out[d.request_id].extend(d.token_ids)
    elapsed = time.perf_counter() - t0
    st = engine.stats
    n = st.spec_drafts
    return Row(out, (sum(map(len, out)) - done) / elapsed, 1 + sum(st.spec_accepted_per_position) / n if n else 1.0,
               [a / n for a in st.spec_accepted_per_position] if n else [], st.spec_draft_tokens / n if n else 0.0)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-file", default=str(_DEFAULT_PROMPT), help="text whose token windows prompt")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (median tok/s)")
    parser.add_argument("--v41-numerics", choices=["row-independent", "reference"], default="row-independent",
                        help="V4.1 only: the engine's numerics mode (engine/v41/numerics.py)")
    args = parser.parse_args()
    print(header("bench_spec_model"), flush=True)
    set_cpu_threads(args.threads)
    model_dir = Path(args.model_dir) if args.model_dir else builtin_model_dir()
    model = load_model(model_dir, dtype=torch.float32, progress=False)
    arch = registry.of(model.cfg)
    reference = arch.capabilities.reference_numerics  # V4.1: its numerics modes (engine/v41/numerics.py)
    drafter = {"mtp": "MTP", "dspark": "DSpark"}[arch.capabilities.drafter]
    numerics = f"{arch.display_name} {args.v41_numerics} numerics" if reference else "fp32"
    if reference:
        from engine.v41.numerics import Numerics

        model.numerics = Numerics(row_independent=args.v41_numerics == "row-independent")
    ids = Tokenizer.from_dir(model_dir).encode(Path(args.prompt_file).read_text())
    print(f"{model_dir.name}, {args.tokens} greedy tokens per sequence after {args.prompt_tokens}-token prompts, "
          f"{numerics}, {args.threads} thread(s)")
    print(f"{'batch':>5} {'speculation':20} {'tok/s':>8} {'vs off':>7} {'accept len':>11} {'drafts/step':>12}"
          "  per-position acceptance")
    for batch in args.batch:
        p = args.prompt_tokens
        prompts = [ids[i * p: (i + 1) * p] for i in range(batch)]
        if len(prompts[-1]) < p:
            raise SystemExit(f"--prompt-file holds {len(ids)} tokens, fewer than {batch} prompts of {p}")
        configs = [("off", 0, False)] + [(f"{drafter} k={k} {'adaptive' if a else 'fixed'}", k, a)
                                         for k in args.k for a in (False, True)]
        runs: dict[str, list[Row]] = {name: [] for name, _, _ in configs}
        for _ in range(args.repeats):
            for name, k, adaptive in configs:
                row = run(model, k, prompts, args.tokens, adaptive)
                runs[name].append(row)
                changed = [i for i, (a, b) in enumerate(zip(row.outputs, runs["off"][0].outputs)) if a != b]
                assert not changed, f"{name}: speculation changed the greedy output of sequences {changed}"
        base = statistics.median(r.tok_s for r in runs["off"])
        for name, _, _ in configs:
            r, tok_s = runs[name][0], statistics.median(x.tok_s for x in runs[name])
            print(f"{batch:5} {name:20} {tok_s:8.2f} {tok_s / base:6.2f}x {r.accept_len:11.2f} "
                  f"{r.drafts_per_step:12.2f}  {' '.join(f'{x:.2f}' for x in r.per_position)}")


if __name__ == "__main__":
    main()
