"""DP imbalance with the token-load router vs round-robin, side by side in one run.

500 requests of mixed lengths (short chats and long documents, short and long answers) go to
`--dp` worker processes on the `tiny` model through the real rings; every 100 ms the benchmark
samples each rank's outstanding work in tokens (queued prefill + live KV from heartbeats +
expected decode, the router's own accounting) and reports the time-averaged max/mean ratio, plus
the wall time to finish everything. Both policies see the same requests in the same order.

    python perf/bench_dp.py [--dp 2] [--requests 500]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from ipc.loop import new_event_loop  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from server.builtin import make_model_dir  # noqa: E402
from server.engine_client import EngineClient  # noqa: E402
from perf.machine import header  # noqa: E402


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.choice([rng.randint(8, 40), rng.randint(300, 700)])
        answer = rng.choice([rng.randint(4, 16), rng.randint(80, 200)])
        out.append(([rng.randrange(3, 500) for _ in range(prompt)], answer))
    return out


async def run(model_dir: Path, dp: int, policy: str, requests, rate: float) -> tuple[float, float]:
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, kv_cache_memory_bytes=64 << 20, block_size=16)
    client = EngineClient(model_dir, config, dp=dp, threads_per_worker=1, routing=policy)
    await client.start()
    ratios: list[float] = []
    done = asyncio.Event()

    async def sample():
        while not done.is_set():
            loads = client.router.loads()
            mean = sum(loads) / len(loads)
            if mean > 0:
                ratios.append(max(loads) / mean)
            await asyncio.sleep(0.1)

    async def one(ids, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for _ in client.generate(ids, params):
            pass

    sampler = asyncio.ensure_future(sample())
    t0 = time.perf_counter()
    tasks = []
    for ids, max_tokens in requests:
        tasks.append(asyncio.ensure_future(one(ids, max_tokens)))
        await asyncio.sleep(1.0 / rate)
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    done.set()
    await sampler
    await client.shutdown()
    return statistics.mean(ratios), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rate", type=float, default=20.0, help="arrivals per second")
    args = parser.parse_args()
    print(header("bench_dp"), flush=True)
    requests = workload(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "tiny", "tiny", dtype="fp32")
        loop = new_event_loop()
        results = {p: loop.run_until_complete(run(model_dir, args.dp, p, requests, args.rate))
                   for p in ("token_load", "round_robin")}
        loop.close()
    print(f"{args.requests} mixed requests over --dp {args.dp}, {args.rate}/s arrivals, tiny model")
    print(f"{'router':12} {'mean max/mean load':>19} {'wall s':>8}")
    for policy, (imbalance, wall) in results.items():
        print(f"{policy:12} {imbalance:19.3f} {wall:8.1f}")


if __name__ == "__main__":
    main()
