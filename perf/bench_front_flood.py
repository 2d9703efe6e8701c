"""`/health` while the front process tokenizes a flood of maximal requests (issue 38, finding 6).

    python perf/bench_front_flood.py [--model DIR] [--requests 64] [--body-mib 4] [--baseline OTHER_CHECKOUT]

Starts `ringserve serve` (the built-in model by default), measures `/health` latency idle, then
sends --requests concurrent requests with bodies just under --body-mib MiB — half `/tokenize`
with a prompt, a quarter `/tokenize` with chat messages, a quarter `/v1/chat/completions` (their
prompts exceed the context, so each ends with a 400 after the template rendered and the text
encoded) — and probes `/health` every 50 ms until all of them are answered. Prints median, p99
and worst probe latency idle and under the flood, the flood's duration, and the front process's
RSS before, at its peak and 3 s after; with --baseline, the same for another checkout, side by
side, with the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from perf.bench_startup import free_port, rss_mib  # noqa: E402
from perf.machine import cpu_model  # noqa: E402


def _text(n_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 9))) for _ in range(n_chars // 5 + 1)]
    return " ".join(words)[:n_chars]


def _bodies(n: int, body_bytes: int, model: str) -> list[tuple[str, dict]]:
    text = _text(body_bytes - 1024, 0)
    out = []
    for i in range(n):
        kind = i % 4
        if kind in (0, 1):
            out.append(("/tokenize", {"prompt": text}))
        elif kind == 2:
            out.append(("/tokenize", {"messages": [{"role": "user", "content": text}]}))
        else:
            out.append(("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                                 "max_tokens": 1}))
    return out


async def _probe(session: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    async with session.get(url + "/health") as r:
        await r.read()
    return time.perf_counter() - t0


# /health probed from a process of its own, so that the client sending the flood (its JSON, its
# reads of long responses) never delays a probe: the latencies are the server's.
_PROBER = """
import http.client, json, select, sys, time
conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=3600)
out, died = [], False
while not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.perf_counter()
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
    except OSError:
        died = True
        break
    out.append(time.perf_counter() - t0)
    time.sleep(0.05)
print(json.dumps({"probes": out, "died": died}))
"""


async def _run(url: str, proc: subprocess.Popen, requests: int, body_bytes: int) -> dict:
    pid = proc.pid
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        idle = [await _probe(session, url) for _ in range(40)]
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        rss0, peak = rss_mib(pid), 0.0
        statuses: list[int] = []
        encoded: dict[int, bytes] = {}
        jobs = [(path, encoded.setdefault(i % 4, json.dumps(body).encode()))
                for i, (path, body) in enumerate(_bodies(requests, body_bytes, model))]

        async def one(path: str, data: bytes) -> None:
            try:
                async with session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    statuses.append(r.status)
            except aiohttp.ClientError:
                statuses.append(0)  # the server went away

        host, port = url.rsplit("/", 1)[1].split(":")
        prober = await asyncio.create_subprocess_exec(sys.executable, "-c", _PROBER, host, port,
                                                      stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        flood = asyncio.ensure_future(asyncio.gather(*(one(path, data) for path, data in jobs)))
        while not flood.done() and proc.poll() is None:
            peak = max(peak, rss_mib(pid))
            await asyncio.sleep(0.1)
        await flood
        took = time.perf_counter() - t0
        prober.stdin.close()
        result = json.loads((await prober.communicate())[0])
        probes = result["probes"]
        died = f"server exited ({proc.wait(30)}) {took:.0f} s into the flood" if result["died"] else None
        await asyncio.sleep(3.0)
        return {"idle": idle, "flood": probes, "took": took, "rss0": rss0, "peak": peak,
                "after": rss_mib(pid) if died is None else float("nan"), "statuses": sorted(set(statuses)),
                "died": died}


def measure(checkout: Path, model: str | None, requests: int, body_bytes: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", *([model] if model else []), "--port", str(port),
           "--kv-cache-memory", "0.5", "--threads-per-worker", "1", "--max-request-bytes", str(body_bytes)]
    proc = subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(checkout)})
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start ({checkout})")
            try:
                with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        return asyncio.run(_run(url, proc, requests, body_bytes))
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def _ms(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--body-mib", type=float, default=4.0)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to measure the same way")
    args = ap.parse_args()
    body = int(args.body_mib * 2**20)
    print(f"# {cpu_model()}; {args.requests} requests of {args.body_mib:g} MiB; /health probe latency in ms")
    print(f"{'checkout':10} {'idle p50':>9} {'idle max':>9} {'flood p50':>10} {'flood p99':>10} {'flood max':>10} "
          f"{'probes':>7} {'flood s':>8} {'RSS MiB before/peak/after':>28} statuses", flush=True)
    runs = {}
    for name, checkout in (("this", ROOT), ("baseline", args.baseline)):
        if checkout is None:
            continue
        r = runs[name] = measure(checkout.resolve(), args.model, args.requests, body)
        flood = r["flood"] or [float("nan")]
        print(f"{name:10} {_ms(r['idle'], .5):9.1f} {_ms(r['idle'], 1):9.1f} {_ms(flood, .5):10.1f} "
              f"{_ms(flood, .99):10.1f} {_ms(flood, 1):10.1f} {len(r['flood']):7d} {r['took']:8.1f} "
              f"{r['rss0']:9.0f}/{r['peak']:6.0f}/{r['after']:6.0f}{'':6} {r['statuses']}", flush=True)
        if r["died"]:
            print(f"{'':10} {r['died']}", flush=True)
    if "baseline" in runs and runs["baseline"]["flood"]:
        b, t = runs["baseline"], runs["this"]
        print(f"ratio baseline/this: flood p50 {statistics.median(b['flood']) / statistics.median(t['flood']):.1f}x, "
              f"flood max {max(b['flood']) / max(t['flood']):.1f}x")


if __name__ == "__main__":
    main()
