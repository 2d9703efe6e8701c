"""PD disaggregation vs colocated serving: TTFT and ITL side by side, and what crossed per request.

Starts (on loopback, NIXL over UCX tcp) a `--kv-role prefill` server, a `--kv-role decode`
server and `ringserve proxy` in front of them, plus a plain colocated server of the same model,
then streams the same requests through both at each concurrency. Reports per setup and
concurrency: median / p90 TTFT, median ITL, throughput; for PD also TTFT split into the prefill
leg (the proxy's `x-pd-prefill-ms`) and the rest (transfer + verify + first decode step + HTTP),
the decode's mean READ and verify times, and bytes moved per request vs the transfer plan
(engine/kv_transfer/plan.py) and vs `kv-report`'s global bytes per token × prompt tokens.

Run: ``python perf/bench_pd.py [MODEL_DIR] [--concurrency 1 4 16] [--requests 8] [--prompt-tokens 200]
[--max-tokens 16] [--json OUT]`` (a tiny model is made when MODEL_DIR is not given).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from perf.machine import header  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp"),
       "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), "NIXL_LOG_LEVEL": "WARN"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, name: str, cmd: list[str], log_dir: Path):
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.log = open(log_dir / f"{name}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", *cmd, "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


async def _one(session, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    times = []
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        prefill_ms = float(r.headers.get("x-pd-prefill-ms", "nan"))
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    ttft = (times[0] - start) * 1e3 if times else float("nan")
    itl = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    return {"ttft_ms": ttft, "itl_ms": itl, "prefill_ms": prefill_ms, "e2e_ms": (time.perf_counter() - start) * 1e3}


async def _run(url: str, prompts: list[list[int]], c: int, max_tokens: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(c)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def go(p):
            async with sem:
                return await _one(session, url, p, max_tokens)

        t0 = time.perf_counter()
        rows = await asyncio.gather(*(go(p) for p in prompts))
        wall = time.perf_counter() - t0
    ttft = sorted(r["ttft_ms"] for r in rows)
    itl = [x for r in rows for x in r["itl_ms"]]
    out = {"ttft_median_ms": statistics.median(ttft), "ttft_p90_ms": ttft[int(0.9 * (len(ttft) - 1))],
           "itl_median_ms": statistics.median(itl) if itl else float("nan"),
           "output_tok_per_s": len(prompts) * max_tokens / wall}
    prefill = [r["prefill_ms"] for r in rows if r["prefill_ms"] == r["prefill_ms"]]
    if prefill:
        out["prefill_leg_median_ms"] = statistics.median(prefill)
        out["after_prefill_median_ms"] = statistics.median(r["ttft_ms"] - r["prefill_ms"] for r in rows)
    return out


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/kv_transfer/stats", timeout=10) as r:
        return json.loads(r.read())["ranks"][0]["kv_transfer"]


def _expected_bytes(model_dir: Path, n: int) -> dict:
    from engine.config import ModelConfig
    from engine.kv_layout import build_layout
    from engine.kv_transfer.plan import make_plan

    layout = build_layout(ModelConfig.from_model_dir(model_dir), "auto", "fp32", 16, num_mtp_layers=0)
    plan = make_plan(layout, n)
    full = plan.group_bytes("full")
    per_token = sum(p.record_bytes * len(p.layers) / p.tokens_per_record for p in layout.pools if p.group == "full")
    return {"plan_bytes": plan.nbytes, "global_bytes": full, "global_bytes_per_token": per_token,
            "global_per_token_x_n": per_token * n, "fixed_state_bytes": plan.nbytes - full}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", nargs="?", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(header("bench_pd"), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    model_dir = Path(args.model_dir) if args.model_dir else tmp / "tiny"
    if args.model_dir is None:
        subprocess.run([sys.executable, "-m", "server.cli", "make-model", str(model_dir), "--preset", "tiny",
                        "--seed", "3"], check=True, capture_output=True)
    seqs = str(max(4, max(args.concurrency)))
    common = [str(model_dir), "--kv-cache-memory", "0.1", "--block-size", "16", "--threads-per-worker", "1",
              "--max-num-seqs", seqs, "--served-model-name", "m"]
    pre = Proc("prefill", ["serve", *common, "--kv-role", "prefill", "--kv-transfer", "nixl"], tmp)
    dec = Proc("decode", ["serve", *common, "--kv-role", "decode", "--kv-transfer", "nixl"], tmp)
    col = Proc("colocated", ["serve", *common], tmp)
    procs = [pre, dec, col]
    try:
        for p in procs:
            p.wait_ready()
        proxy = Proc("proxy", ["proxy", "--prefill", pre.url, "--decode", dec.url], tmp)
        procs.append(proxy)
        proxy.wait_ready()
        n = args.prompt_tokens
        prompts = [[(31 * i + 7 * j) % 200 + 1 for j in range(n)] for i in range(args.requests)]
        asyncio.run(_run(col.url, prompts[:1], 1, 2))  # warm both paths (and the NIXL handshake)
        asyncio.run(_run(proxy.url, prompts[:1], 1, 2))
        result = {"prompt_tokens": n, "max_tokens": args.max_tokens, "requests": args.requests, "runs": []}
        for c in args.concurrency:
            for setup, url in (("colocated", col.url), ("pd", proxy.url)):
                before = _stats(dec.url)
                row = {"setup": setup, "concurrency": c, **asyncio.run(_run(url, prompts, c, args.max_tokens))}
                if setup == "pd":
                    after = _stats(dec.url)
                    loads = after["loaded"] - before["loaded"]
                    row["bytes_per_request"] = (after["bytes_read"] - before["bytes_read"]) / max(1, loads)
                    row["read_mean_ms"] = (after["read_s"] - before["read_s"]) * 1e3 / max(1, loads)
                    row["last_verify_ms"] = after["last_verify_s"] * 1e3
                result["runs"].append(row)
                print(json.dumps(row), flush=True)
        result["bytes"] = _expected_bytes(model_dir, n)
        print(json.dumps(result["bytes"]))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    main()
