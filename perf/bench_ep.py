"""Expert-parallel MoE layer on CPU: step time and all-to-all bytes per token at EP 1/2/4 (gloo).

Each EP size spawns that many ranks on 127.0.0.1 (DEP: every rank brings its own --tokens
tokens; the E experts are split evenly). A step is the routed MoE of one layer: map to slots →
dispatch → SwiGLU experts on the local slots (grouped GEMMs, as engine/v4/moe.py) → combine, after a
barrier so the ranks start together. Reported per backend: medians over the steps of the slowest
rank's times, and the bytes each rank sent to OTHER ranks per token next to the ideal
tokens·k·H·bytes·2 (dispatch + combine, every row crossing the wire once) and the ideal for
uniform routing, which keeps a 1/EP share on the rank itself.

    python perf/bench_ep.py [--ep 1 2 4] [--tokens 64] [--hidden 512] [--experts 16] [--top-k 4]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.distributed import eplb  # noqa: E402
from engine.distributed.all2all import NaiveAllGather, PaddedA2A, SlotLayout, TorchA2A  # noqa: E402
from engine.distributed.ep_moe import map_to_physical  # noqa: E402
from engine.distributed.group import init_group, pick_free_port  # noqa: E402
from engine.v4.layers import clamped_swiglu  # noqa: E402
from perf.machine import cpu_model, set_cpu_threads  # noqa: E402

BACKENDS = ("torch", "padded", "naive")


def make_backend(name: str, layout: SlotLayout, args) -> object:
    if name == "padded":
        # capacity_factor × the uniform share of one rank's T·k rows per destination
        rows = args.tokens * args.top_k
        cap = min(rows, math.ceil(rows / layout.num_ranks * args.capacity_factor))
        return PaddedA2A(layout, capacity=cap)
    return {"torch": TorchA2A, "naive": NaiveAllGather}[name](layout)


def grouped_swiglu(w13: torch.Tensor, w2: torch.Tensor, limit: float = 10.0):
    inter = w2.shape[2]

    def compute(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = counts.cumsum(0).to(torch.int32)
        h = F.grouped_mm(x, w13.transpose(1, 2), offs=ends)  # [S, 2I]
        return F.grouped_mm(clamped_swiglu(h[:, :inter], h[:, inter:], limit), w2.transpose(1, 2), offs=ends)

    return compute


def rank_main(rank: int, ep: int, port: int, args, out_dir: str) -> None:
    set_cpu_threads(args.threads)
    group = init_group(rank, ep, "127.0.0.1", port, "gloo", f"bench-{port}", timeout_s=120)
    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    g = torch.Generator().manual_seed(rank + 1)
    layout = SlotLayout(e, ep)
    l2p, count = eplb.identity_placement(1, e, ep).layer_maps(0)
    local = slice(rank * layout.slots_per_rank, (rank + 1) * layout.slots_per_rank)
    wg = torch.Generator().manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=wg) * 0.05)[local].contiguous()
    w2 = (torch.randn(e, h, i, generator=wg) * 0.05)[local].contiguous()
    experts = grouped_swiglu(w13, w2)
    x = torch.randn(args.tokens, h, generator=g)
    ids = torch.rand(args.tokens, e, generator=g).argsort(dim=1)[:, :k].to(torch.int32)  # uniform, distinct
    weights = torch.rand(args.tokens, k, generator=g)
    result = {}
    for name in BACKENDS:
        a2a = make_backend(name, layout, args)
        steps = []
        for it in range(args.warmup + args.iters):
            if it == args.warmup:
                a2a.stats.reset()
            dist.barrier(group=group.cpu_group)
            t0 = time.perf_counter()
            d = a2a.dispatch(x, map_to_physical(ids, l2p, count, rank), weights)
            t1 = time.perf_counter()
            y = experts(d.x, d.counts)
            t2 = time.perf_counter()
            a2a.combine(y, d)
            t3 = time.perf_counter()
            if it >= args.warmup:
                steps.append([t3 - t0, t1 - t0, t2 - t1, t3 - t2])
        slowest = torch.tensor(steps, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group.cpu_group)  # the lockstep step is the slowest rank's
        s = a2a.stats
        result[name] = {"median_ms": [1e3 * statistics.median(col) for col in slowest.T.tolist()],
                        "payload_per_token": (s.dispatch_bytes + s.combine_bytes) / (args.iters * args.tokens),
                        "header_per_token": s.header_bytes / (args.iters * args.tokens)}
    group.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_ep(ep: int, args) -> list[dict]:
    spawn = multiprocessing.get_context("spawn")
    port = pick_free_port("127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [spawn.Process(target=rank_main, args=(r, ep, port, args, tmp)) for r in range(ep)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"EP {ep}: ranks exited with {[p.exitcode for p in procs]}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ep)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inter", type=int, default=256, help="expert intermediate size")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--capacity-factor", type=float, default=2.0, help="PaddedA2A capacity vs the uniform share")
    args = parser.parse_args()
    elem = 4  # fp32
    ideal = args.top_k * args.hidden * elem * 2  # bytes per token, dispatch + combine
    print(f"# {cpu_model()}; {len(os.sched_getaffinity(0))} usable cores; torch {torch.__version__}; gloo on 127.0.0.1")
    print(f"# T={args.tokens} tokens/rank, H={args.hidden}, I={args.inter}, E={args.experts}, k={args.top_k}, fp32, "
          f"{args.threads} thread(s)/rank, medians of {args.iters} steps (slowest rank), uniform routing")
    print(f"{'EP':>3} {'backend':8} {'layer ms':>9} {'dispatch':>9} {'experts':>8} {'combine':>8} "
          f"{'B/token sent':>13} {'header':>7} {'ideal':>7} {'ideal uniform':>14}")
    for ep in args.ep:
        ranks = run_ep(ep, args)
        for name in BACKENDS:
            ms = ranks[0][name]["median_ms"]  # identical on every rank after the MAX all_reduce
            sent = statistics.mean(r[name]["payload_per_token"] for r in ranks)
            header = statistics.mean(r[name]["header_per_token"] for r in ranks)
            print(f"{ep:>3} {name:8} {ms[0]:9.3f} {ms[1]:9.3f} {ms[2]:8.3f} {ms[3]:8.3f} "
                  f"{sent:13.0f} {header:7.1f} {ideal:7d} {ideal * (ep - 1) / ep:14.0f}")


if __name__ == "__main__":
    main()
