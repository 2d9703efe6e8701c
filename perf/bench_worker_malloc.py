"""A CPU worker's malloc with and without transparent huge pages, side by side in one run.

A CPU worker starts with glibc's `glibc.malloc.hugetlb=1` tunable (server/worker_entry.py
`worker_env`). This runs the same engine work in fresh child processes, alternating the
environment without the tunable ("4 KiB") and with it ("THP"), since the tunable is read once at
process start: a prefill of --batch prompts of --prompt-len tokens (one output token each,
--prefills times after a warm-up), then one prompt decoded greedily for --decode tokens at
batch 1. Each child reports its medians, its minor page faults and its system CPU time; the
parent prints the medians over --rounds children of each kind and the ratios 4 KiB / THP.

    python perf/bench_worker_malloc.py --model-dir .peer-cache/models/wide-fp8 [--threads 2]
        [--batch 16] [--prompt-len 128] [--prefills 3] [--decode 64] [--rounds 3]

(.peer-cache/models/NAME: python perf/peer_llamacpp.py make-model DIR --geometry NAME)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from perf.machine import header  # noqa: E402
from server.worker_entry import HUGE_PAGE_TUNABLE, transparent_huge_pages_mode, worker_env  # noqa: E402


def child(a: argparse.Namespace) -> None:
    """One measurement in this process; prints one JSON line."""
    from server.worker_entry import pin_cpu_threads

    pin_cpu_threads(a.threads)                          # before numba is imported, as a worker does
    import resource
    import time

    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.weights import load_model
    from ipc.messages import SamplingParams
    from kernels import cpu_precision

    torch.set_num_threads(a.threads)
    cpu_precision.apply("auto")
    engine = Engine(load_model(a.model_dir, dtype=torch.float32, progress=False), EngineConfig())
    vocab = engine.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    counter = itertools.count()

    def run(prompts: int, out: int) -> list[float]:
        """Seconds to the first token, then seconds a token after it."""
        for _ in range(prompts):
            ids = torch.randint(5, vocab - 1, (a.prompt_len,), generator=g).tolist()
            engine.add_request(f"r{next(counter)}", ids, SamplingParams(max_tokens=out, ignore_eos=True))
        t0 = time.perf_counter()
        first = None
        while engine.has_work:
            if engine.step().deltas and first is None:
                first = time.perf_counter() - t0
        total = time.perf_counter() - t0
        return [first, (total - first) / max(out - 1, 1)]

    run(a.batch, 1)                                     # warm-up: numba cache loads, first touches
    usage = resource.getrusage(resource.RUSAGE_SELF)
    prefill = [run(a.batch, 1)[0] for _ in range(a.prefills)]
    after = resource.getrusage(resource.RUSAGE_SELF)
    run(1, 2)                                           # the batch-1 step's first call builds its program
    decode = run(1, a.decode)[1]
    print(json.dumps({"prefill_s": statistics.median(prefill), "decode_s": decode,
                      "faults": (after.ru_minflt - usage.ru_minflt) / a.prefills,
                      "sys_s": (after.ru_stime - usage.ru_stime) / a.prefills}))


def measure(a: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model-dir", a.model_dir, "--threads", str(a.threads),
           "--batch", str(a.batch), "--prompt-len", str(a.prompt_len), "--prefills", str(a.prefills),
           "--decode", str(a.decode)]
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--prefills", type=int, default=3)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return
    print(header("bench_worker_malloc"))
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    envs = {"4 KiB": base, "THP": worker_env("cpu", base)}
    results: dict[str, list[dict]] = {k: [] for k in envs}
    for _ in range(a.rounds):                           # alternated: drifts in the machine hit both
        for kind, env in envs.items():
            results[kind].append(measure(a, env))
    print(f"# {a.model_dir}; {a.threads} thread(s); prefill {a.batch} x {a.prompt_len} tokens (median of {a.prefills}), "
          f"batch-1 decode of {a.decode} tokens; medians of {a.rounds} alternating children; THP mode "
          f"{transparent_huge_pages_mode()}; THP = GLIBC_TUNABLES={envs['THP']['GLIBC_TUNABLES']} "
          f"({HUGE_PAGE_TUNABLE[0]})")
    print(f"{'malloc':>8} {'prefill ms':>11} {'faults/prefill':>15} {'sys s/prefill':>14} {'decode ms/tok':>14}")
    med = {k: {f: statistics.median(r[f] for r in rs) for f in rs[0]} for k, rs in results.items()}
    for kind, m in med.items():
        print(f"{kind:>8} {m['prefill_s'] * 1e3:11.1f} {m['faults']:15.0f} {m['sys_s']:14.2f} {m['decode_s'] * 1e3:14.2f}")
    off, on = med["4 KiB"], med["THP"]
    print(f"{'4K/THP':>8} {off['prefill_s'] / on['prefill_s']:10.2f}x {off['faults'] / max(on['faults'], 1):14.1f}x "
          f"{off['sys_s'] / max(on['sys_s'], 1e-9):13.2f}x {off['decode_s'] / on['decode_s']:13.2f}x")


if __name__ == "__main__":
    main()
