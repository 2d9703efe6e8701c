"""MTP speculation on vs off at batch 1, side by side: tokens/s and acceptance.

With random weights the MTP head's drafts are almost never right, so this measures the
mechanism's cost when drafts fail, with all k drafts verified every step ('fixed') and with
load-adaptive speculation ('adaptive', the default: it stops verifying drafts that fail);
`--oracle` adds runs whose drafts are forced to the true continuation (what a well-trained
draft head approaches), bounding the gain from above.

    python perf/bench_spec.py [--preset small] [--tokens 128] [--k 3] [--oracle]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.v4.checkpoint import preset_config, random_state, write_checkpoint  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from engine.weights import load_model  # noqa: E402
from perf.machine import header  # noqa: E402


def run(model, k: int, prompt: list[int], tokens: int, oracle: list[int] | None = None, adaptive: bool = True):
    engine = Engine(model, EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, speculative_tokens=k,
                                        kv_cache_memory_bytes=256 << 20, adaptive_speculation=adaptive))
    if oracle is not None:
        engine.runner.draft_override = lambda req, acc, d: oracle[req.num_output_tokens + len(acc):][:k] or d
    engine.add_request(0, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    out = [t for d in engine.step().deltas for t in d.token_ids]  # prefill and the first token (not timed)
    t0 = time.perf_counter()
    while engine.has_work:
        for d in engine.step().deltas:
            out.extend(d.token_ids)
    elapsed = time.perf_counter() - t0
    st = engine.stats
    accepted = sum(st.spec_accepted_per_position)
    mean_len = 1 + accepted / st.spec_drafts if st.spec_drafts else 1.0
    per_pos = [a / st.spec_drafts for a in st.spec_accepted_per_position] if st.spec_drafts else []
    return out, (len(out) - 1) / elapsed, mean_len, per_pos


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--oracle", action="store_true")
    args = parser.parse_args()
    print(header("bench_spec"), flush=True)
    cfg = preset_config(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, cfg, random_state(cfg, 0), dtype=torch.float32)
        model = load_model(tmp, dtype=torch.float32, progress=False)
    prompt = torch.randint(2, cfg.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    base, tps0, _, _ = run(model, 0, prompt, args.tokens)
    rows = [("off", tps0, 1.0, [])]
    for adaptive in (False, True):
        spec, tps, length, per_pos = run(model, args.k, prompt, args.tokens, adaptive=adaptive)
        assert spec == base, "speculation changed greedy output"
        rows.append((f"MTP k={args.k} {'adaptive' if adaptive else 'fixed'}", tps, length, per_pos))
    if args.oracle:
        for adaptive in (False, True):
            orc, tps, length, per_pos = run(model, args.k, prompt, args.tokens, oracle=base, adaptive=adaptive)
            assert orc == base
            rows.append((f"oracle k={args.k} {'adaptive' if adaptive else 'fixed'}", tps, length, per_pos))
    print(f"{args.preset} preset, batch 1, {args.tokens} greedy tokens after a 128-token prompt, fp32")
    print(f"{'speculation':20} {'tok/s':>8} {'vs off':>7} {'accept len':>11}  per-position acceptance")
    for name, t, length, pos in rows:
        print(f"{name:20} {t:8.2f} {t / tps0:6.2f}x {length:11.2f}  {' '.join(f'{p:.2f}' for p in pos)}")


if __name__ == "__main__":
    main()
