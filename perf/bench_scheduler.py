"""Host time per engine step with the model forward taken out (a null model).

The null model has the real interfaces (forward over a flattened batch, logits, per-sequence
state) but does no maths: what remains is scheduling, block allocation, input building,
sampling bookkeeping and the update. Measured at batch 1, 64 and 256 in steady decode, on the
per-sequence path (CPU default, mixed steps) and on the static-shape path that GPU decode steps
take (its inputs filled exactly as before a CUDA-graph replay; the replay itself is one launch).
Goal: ≤ 0.5 ms per step at batch 256 (a GPU decode step it must hide behind is a few ms).

    python perf/bench_scheduler.py [--steps 200] [--vocab 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.v4.checkpoint import preset_config  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from perf.machine import header  # noqa: E402


class NullModel(nn.Module):
    """Same surface as DeepseekV4, no computation: zero streams, constant logits."""

    def __init__(self, vocab: int):
        super().__init__()
        self.cfg = preset_config("small", vocab_size=max(vocab, 512))
        self.vocab = vocab
        self.embed = nn.Parameter(torch.zeros(1, 1), requires_grad=False)
        self.mtp = nn.ModuleList()
        self.dtype, self.device = torch.float32, torch.device("cpu")

    def forward(self, token_ids, positions, ctx):
        return torch.zeros(token_ids.shape[0], 1, 1)

    def logits(self, streams):
        out = torch.zeros(streams.shape[0], self.vocab)
        out[:, 7] = 1.0  # greedy always picks token 7 (never EOS)
        return out


def measure(batch: int, steps: int, vocab: int, static: bool = False) -> float:
    model = NullModel(vocab)
    engine = Engine(model, EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(batch, 256), block_size=256,
                                        num_kv_blocks=batch * 8 + 8, kv_cache_memory_bytes=1 << 30,
                                        static_decode=static, cuda_graph_sizes=(1, 64, 256)))
    params = SamplingParams(max_tokens=30000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(i, [5] * 64, params)
    while any(r.num_computed_tokens < 64 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill out of the way
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=32)
    args = parser.parse_args()
    print(header("bench_scheduler"), flush=True)
    torch.set_num_threads(1)
    print(f"null model, steady greedy decode, median of {args.steps} steps, vocab {args.vocab}")
    print(f"{'batch':>6} {'per-sequence ms':>16} {'static ms':>10} {'static µs/request':>18}")
    for batch in (1, 64, 256):
        eager = measure(batch, args.steps, args.vocab)
        static = measure(batch, args.steps, args.vocab, static=True)
        print(f"{batch:6d} {eager * 1e3:16.3f} {static * 1e3:10.3f} {static * 1e6 / batch:18.1f}")


if __name__ == "__main__":
    main()
