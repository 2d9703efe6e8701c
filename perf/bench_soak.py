"""Loop pauses over a long run: the worker serving a steady random load for --seconds.

Reports the longest gap between two engine steps while work was waiting (host-side pauses:
scheduling, IO, GC) and the longest GC pause inside the token path, after gc.freeze().

    python perf/bench_soak.py [--seconds 300] [--preset tiny] [--speculative-tokens 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
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
from engine.worker import Worker  # noqa: E402
from ipc.loop import new_event_loop  # noqa: E402
from perf.machine import header  # noqa: E402


async def soak(worker: Worker, seconds: float, vocab: int) -> int:
    rng = random.Random(0)
    done = {"n": 0}

    def emit(out):
        done["n"] += len(out.finished)

    worker.emit = emit
    task = asyncio.ensure_future(worker.run())
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        if len(worker.engine.scheduler.requests) < 12:
            ids = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 200))]
            worker.submit(i, ids, SamplingParams(max_tokens=rng.randint(4, 64), ignore_eos=True))
            i += 1
        await asyncio.sleep(0.01)
    worker.stop()
    await task
    return done["n"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--speculative-tokens", type=int, default=0, help="MTP drafts (adaptive), 0 = off")
    args = parser.parse_args()
    print(header("bench_soak"), flush=True)
    cfg = preset_config(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, cfg, random_state(cfg, 0), dtype=torch.float32)
        model = load_model(tmp, dtype=torch.float32, progress=False, load_mtp=args.speculative_tokens > 0)
    engine = Engine(model, EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, kv_cache_memory_bytes=64 << 20,
                                        speculative_tokens=args.speculative_tokens))
    worker = Worker(engine, lambda d: None)
    worker.warm_up()
    loop = new_event_loop()
    finished = loop.run_until_complete(soak(worker, args.seconds, cfg.vocab_size))
    loop.close()
    s = worker.stats
    print(f"{args.preset} preset, {args.seconds:.0f} s soak, speculative tokens {args.speculative_tokens}, "
          f"{finished} requests finished, {s.steps} steps")
    print(f"longest loop pause between steps: {s.max_loop_pause_s * 1e3:.2f} ms")
    print(f"longest GC pause in the token path: {s.max_gc_pause_s * 1e3:.2f} ms")
    print(f"longest engine step: {engine.stats.max_step_s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
