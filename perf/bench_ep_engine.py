"""Expert parallelism through the real workers, side by side in one run (CPU, gloo).

Three tables, all through `EngineClient` (the path `serve` takes) on one random-weight model:

1. Throughput: the same requests at DP2 (every rank holds every expert) and DP2+EP (each rank
   holds half), output tok/s and each rank's routed-expert bytes.
2. EPLB under skewed expert load (a model whose hot experts all start on rank 0): the
   per-layer expert imbalance (max/mean of per-rank expert tokens) of the first EPLB window and of
   the last, with and without --enable-eplb (same redundant experts, same windows).
3. DP imbalance (the router's max/mean outstanding tokens per rank, sampled every 100 ms) under
   the AgentX-like workload of `ringserve bench` (prompt and output lengths of its sessions,
   submitted turn by turn, sessions concurrent), token-load routing.

    python perf/bench_ep_engine.py [--requests 32] [--max-tokens 24] [--experts 16] [--top-k 4] [--tables 1 2 3]
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

from engine.config import EngineConfig, ParallelConfig  # noqa: E402
from ipc.loop import new_event_loop  # noqa: E402
from ipc.messages import Finished, SamplingParams  # noqa: E402
from server.engine_client import EngineClient  # noqa: E402
from perf.machine import cpu_model  # noqa: E402


def make_model(out: Path, experts: int, top_k: int, hot: list[int] | None = None) -> Path:
    """A random tiny model; with `hot` (top_k expert ids), those experts of every layer are hot
    (a router bias that always selects them; the hash layers' table sends every token to them):
    the skew real models show."""
    import torch

    from engine.v4.checkpoint import preset_config, random_state, write_checkpoint

    cfg = preset_config("tiny", n_routed_experts=experts, num_experts_per_tok=top_k, index_topk=64)
    state = random_state(cfg, 0)
    for name, t in state.items():
        if hot and name.endswith("ffn.gate_bias"):
            t[hot] += 5.0
        elif hot and name.endswith("ffn.tid2eid"):
            t.copy_(torch.tensor(hot, dtype=t.dtype).repeat(t.shape[0], 1))  # the hot experts for every token
    write_checkpoint(out, cfg, state, layout="upstream", dtype=torch.float32)
    return out


def experts_of_rank0_at_start(experts: int, redundant: int, ranks: int, k: int) -> list[int]:
    """k logical experts that the starting placement (EPLB of a uniform load) puts on rank 0 only."""
    import numpy as np

    from engine.distributed import eplb

    start = eplb.rebalance(np.ones((1, experts)), ranks, redundant)
    others = {int(e) for r in range(1, ranks) for e in start.local_experts(0, r)}
    mine = [int(e) for e in dict.fromkeys(start.local_experts(0, 0).tolist()) if int(e) not in others]
    if len(mine) < k:
        raise SystemExit(f"rank 0 holds only {len(mine)} experts of its own; use more experts")
    return mine[:k]


def config() -> EngineConfig:
    return EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, kv_cache_memory_bytes=64 << 20, block_size=16)


async def _serve(model_dir: Path, parallel: ParallelConfig, requests: list[tuple[list[int], int]],
                 concurrent: bool = True, sample=None) -> dict:
    """Run `requests` through a fresh client; wall time, output tokens, last heartbeats."""
    client = EngineClient(model_dir, config(), threads_per_worker=1, parallel=parallel)
    await client.start()
    try:
        beats_seen: list[list] = []
        done = asyncio.Event()

        async def watch():
            while not done.is_set():
                beats_seen.append([r.last_beat for r in client.ranks])
                if sample is not None:
                    sample(client)
                await asyncio.sleep(0.1)

        async def one(ids, max_tokens):
            n = 0
            async for item in client.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
                if isinstance(item, Finished):
                    if item.reason != "length":
                        raise SystemExit(f"a request failed: {item.error}")
                else:
                    n += len(item.token_ids)
            return n

        watcher = asyncio.ensure_future(watch())
        t0 = time.perf_counter()
        if concurrent:
            tokens = sum(await asyncio.gather(*(one(ids, m) for ids, m in requests)))
        else:
            tokens = 0
            for ids, m in requests:
                tokens += await one(ids, m)
        wall = time.perf_counter() - t0
        done.set()
        await watcher
        beats_seen.append([r.last_beat for r in client.ranks])
        return {"wall": wall, "tokens": tokens, "beats": beats_seen}
    finally:
        await client.shutdown()


def expert_bytes_per_rank(model_dir: Path, parallel: ParallelConfig) -> list[int]:
    """Routed-expert bytes each rank loads (the placement the workers use; the loader reads only these)."""
    from engine.config import ModelConfig
    from engine.distributed.expert_parallel import experts_to_load, initial_placement

    cfg = ModelConfig.from_model_dir(model_dir)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4  # w1, w3, w2 in fp32
    if not parallel.enable_expert_parallel:
        return [cfg.num_layers * cfg.n_routed_experts * per_expert] * parallel.data_parallel_size
    placement = initial_placement(cfg, 0, parallel)
    return [sum(len(v) for v in experts_to_load(placement, rank).values()) * per_expert
            for rank in range(parallel.data_parallel_size)]


def agentx_requests() -> list[list[tuple[int, int]]]:
    """Per session (and sub-agent), its turns as (prompt tokens, output tokens)."""
    from perf.serving import agentx

    out = []

    def walk(sess):
        out.append([(r.input_length, r.output_length) for r in sess.requests])
        for kids in sess.children.values():
            for kid in kids:
                walk(kid)

    for tree in agentx.generate(agentx.params_from("cpu", num_sessions=6, turns=(2, 4), max_context=1024,
                                                   long_output=(32, 64))):
        walk(tree)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--eplb-interval", type=int, default=8)
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3], help="which tables to run")
    args = parser.parse_args()
    rng = random.Random(0)
    uniform = [([rng.randrange(3, 500) for _ in range(rng.randint(8, 64))], args.max_tokens)
               for _ in range(args.requests)]
    skewed = uniform  # the skew is the model's (hot experts), the requests are the same

    loop = new_event_loop()
    print(f"# bench_ep_engine — {cpu_model()}, tiny preset with {args.experts} experts top-{args.top_k}, fp32, "
          f"1 thread per rank")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "m", args.experts, args.top_k)

        if 1 in args.tables:
            throughput_table(loop, model_dir, uniform, args)
        if 2 in args.tables:
            eplb_table(loop, Path(tmp), skewed, args)
        if 3 in args.tables:
            agentx_table(loop, model_dir)
    loop.close()


def throughput_table(loop, model_dir: Path, requests, args) -> None:
    print(f"\n## 1. throughput, {args.requests} requests × {args.max_tokens} tokens, all at once")
    print(f"{'setup':10} {'wall s':>7} {'out tok/s':>10} {'expert MiB per rank':>20}")
    for name, par in (("DP2", ParallelConfig(data_parallel_size=2)),
                      ("DP2+EP", ParallelConfig(data_parallel_size=2, enable_expert_parallel=True))):
        r = loop.run_until_complete(_serve(model_dir, par, requests))
        mib = "/".join(f"{b / 2**20:.2f}" for b in expert_bytes_per_rank(model_dir, par))
        print(f"{name:10} {r['wall']:7.2f} {r['tokens'] / r['wall']:10.1f} {mib:>20}")


def eplb_table(loop, tmp: Path, requests, args) -> None:
    hot = experts_of_rank0_at_start(args.experts, 2, 2, args.top_k)
    hot_dir = make_model(tmp / "hot", args.experts, args.top_k, hot=hot)
    print(f"\n## 2. EPLB, skewed load (experts {hot} hot in every layer, all on rank 0 at start), "
          f"2 redundant experts, window {args.eplb_interval} steps")
    print(f"{'setup':18} {'first window max/mean':>22} {'last window':>12} {'rebalances':>11}")
    for eplb in (False, True):
        par = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2,
                             enable_eplb=eplb, eplb_step_interval=args.eplb_interval)
        r = loop.run_until_complete(_serve(hot_dir, par, requests))
        # Rank 0's heartbeats carry the imbalance of the last finished window (every rank the same):
        # valid once the first window closed, i.e. from step eplb_interval on.
        windows = [b[0].expert_imbalance for b in r["beats"]
                   if b[0] is not None and b[0].expert_imbalance and b[0].step >= args.eplb_interval]
        first = statistics.mean(windows[0]) if windows else float("nan")
        last = statistics.mean(windows[-1]) if windows else float("nan")
        label = "EP, EPLB" if eplb else "EP, measure only"
        print(f"{label:18} {first:22.3f} {last:12.3f} {r['beats'][-1][0].eplb_rebalances:11d}")


def agentx_table(loop, model_dir: Path) -> None:
    print("\n## 3. DP imbalance (router max/mean outstanding tokens) under the AgentX-like workload, DP2+EP")
    sessions = agentx_requests()
    samples: list[float] = []

    async def run() -> float:
        client_par = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
        client = EngineClient(model_dir, config(), threads_per_worker=1, parallel=client_par)
        await client.start()
        try:
            done = asyncio.Event()

            async def watch():
                while not done.is_set():
                    loads = client.router.loads()
                    if loads and sum(loads) > 0:
                        samples.append(max(loads) / (sum(loads) / len(loads)))
                    await asyncio.sleep(0.1)

            async def session(i, turns):
                r = random.Random(i)
                for prompt, out in turns:
                    ids = [r.randrange(3, 500) for _ in range(prompt)]
                    async for _ in client.generate(ids, SamplingParams(max_tokens=out, ignore_eos=True),
                                                   session=f"s{i}"):
                        pass

            watcher = asyncio.ensure_future(watch())
            t0 = time.perf_counter()
            await asyncio.gather(*(session(i, t) for i, t in enumerate(sessions)))
            wall = time.perf_counter() - t0
            done.set()
            await watcher
            return wall
        finally:
            await client.shutdown()

    wall = loop.run_until_complete(run())
    turns = sum(len(t) for t in sessions)
    print(f"{len(sessions)} sessions, {turns} turns, {wall:.1f} s: max/mean mean {statistics.mean(samples):.3f}, "
          f"median {statistics.median(samples):.3f}, p90 {sorted(samples)[int(0.9 * len(samples))]:.3f}")


if __name__ == "__main__":
    main()
