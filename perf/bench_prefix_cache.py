"""Prefix caching on an AgentX-shaped workload, in process: caching off, exact and bounded.

Sessions resend their growing conversation every turn: turn 0 is a shared system prompt plus a
per-session task, each later turn is the previous prompt + its answer + a tool output. A round
sends one turn of every session at once and waits for all of them (the think time between
turns is the gap). The caching-off run is done first and fixes the transcript (answers are
its greedy outputs), so every mode gets the same prompts; outputs that then differ from it are
the bounded mode's divergence (exact must show none). Printed side by side per mode: achieved
hit rate (hit tokens / prompt tokens), TTFT p50/p90 (add → first token), output tok/s, wall
time, tokens recomputed per hit (the replay cost), diverging requests.

    python perf/bench_prefix_cache.py [--preset tiny|small] [--sessions 6] [--turns 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.v4.checkpoint import preset_config, random_state, write_checkpoint  # noqa: E402
from engine.weights import load_model  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from perf.machine import header  # noqa: E402

MODES = {"off": dict(enable_prefix_caching=False), "exact": dict(prefix_replay="exact"),
         "bounded": dict(prefix_replay="bounded")}


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_round(engine: Engine, prompts: dict[int, list[int]], params: SamplingParams, first_id: int):
    """Send every prompt at once, step until all finish: (outputs, TTFT seconds) by session."""
    t0 = time.perf_counter()
    for s, p in prompts.items():
        engine.add_request(first_id + s, p, params)
    outs: dict[int, list[int]] = {s: [] for s in prompts}
    ttft: dict[int, float] = {}
    while engine.has_work:
        for d in engine.step().deltas:
            s = d.request_id - first_id
            if s not in ttft and d.token_ids:
                ttft[s] = time.perf_counter() - t0
            outs[s].extend(d.token_ids)
    return outs, ttft


def run_mode(model, mode: str, args, transcript: list[dict[int, list[int]]] | None):
    """Run every round; with no transcript, build it from this run's outputs (the `off` run)."""
    vocab = model.cfg.vocab_size
    cfg = EngineConfig(max_num_seqs=args.sessions, max_num_batched_tokens=args.batched_tokens,
                       kv_cache_memory_bytes=args.kv_mib << 20, block_size=args.block_size, **MODES[mode])
    engine = Engine(model, cfg)
    params = SamplingParams(max_tokens=args.output, ignore_eos=True)
    system = _tokens(args.system, 1, vocab)
    prompts = {s: system + _tokens(args.task, 100 + s, vocab) for s in range(args.sessions)}
    rounds, ttfts, outputs = [], [], []
    t0 = time.perf_counter()
    for t in range(args.turns):
        if transcript is not None:
            prompts = transcript[t]
        rounds.append(dict(prompts))
        outs, ttft = run_round(engine, prompts, params, t * args.sessions)
        outputs.append(outs)
        ttfts += list(ttft.values())
        prompts = {s: p + outs[s] + _tokens(args.tool, 1000 * t + s, vocab) for s, p in prompts.items()}
    wall = time.perf_counter() - t0
    pc = engine.prefix_cache
    st = pc.stats if pc is not None else None
    return dict(mode=mode, rounds=rounds, outputs=outputs, ttfts=ttfts, wall=wall, stats=st,
                out_tokens=sum(len(o) for r in outputs for o in r.values()))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(results: list[dict]) -> None:
    base = results[0]
    cols = ["mode", "hit rate", "TTFT p50 ms", "TTFT p90 ms", "out tok/s", "wall s", "recomputed/hit",
            "diverged"]
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in results:
        st = r["stats"]
        hit = f"{st.hits / st.queries:.3f}" if st and st.queries else "n/a"
        per_hit = f"{st.replayed_tokens / st.hit_requests:.1f}" if st and st.hit_requests else "n/a"
        diverged = sum(o != base["outputs"][t][s] for t, rnd in enumerate(r["outputs"]) for s, o in rnd.items())
        total = sum(len(rnd) for rnd in r["outputs"])
        row = [r["mode"], hit, f"{1e3 * _pct(r['ttfts'], 0.5):.1f}", f"{1e3 * _pct(r['ttfts'], 0.9):.1f}",
               f"{r['out_tokens'] / r['wall']:.1f}", f"{r['wall']:.2f}", per_hit, f"{diverged}/{total}"]
        print(" | ".join(f"{c:>14}" for c in row))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=96, help="shared system-prompt tokens")
    p.add_argument("--task", type=int, default=40, help="per-session first-turn tokens")
    p.add_argument("--tool", type=int, default=24, help="tool-output tokens appended per turn")
    p.add_argument("--output", type=int, default=8, help="tokens generated per turn")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batched-tokens", type=int, default=256)
    p.add_argument("--kv-mib", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = p.parse_args()
    print(header("bench_prefix_cache"), flush=True)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        cfg = preset_config(args.preset)
        write_checkpoint(d, cfg, random_state(cfg, 0), dtype=torch.float32)
        model = load_model(d, dtype=torch.float32 if args.device == "cpu" else torch.bfloat16, device=args.device,
                           progress=False)
    modes = ["off"] + [m for m in args.modes if m != "off"]
    results = [run_mode(model, modes[0], args, None)]
    transcript = results[0]["rounds"]
    for mode in modes[1:]:
        results.append(run_mode(model, mode, args, transcript))
    print(f"preset {args.preset}, {args.sessions} sessions × {args.turns} turns, block {args.block_size}, "
          f"window {model.cfg.sliding_window}, device {args.device}")
    report(results)


if __name__ == "__main__":
    main()
