"""`ringserve serve` start-up: seconds to /ready, and the resident memory of the front process and
of its worker, for this checkout and (side by side, same model, same run) another checkout.

    python perf/bench_startup.py [--model DIR] [--baseline PATH_TO_OTHER_CHECKOUT] [--runs 3]

Without --model it writes a tiny checkpoint to a temporary directory. Medians over --runs.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from perf.machine import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(checkout: Path, model: Path) -> tuple[float, float, float]:
    """(seconds to /ready, front RSS MiB, worker RSS MiB) of one start."""
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", str(model), "--port", str(port), "--kv-cache-memory", "0.05",
           "--block-size", "16", "--threads-per-worker", "1"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(checkout)})
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode} ({checkout})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.05)
        ready = time.perf_counter() - t0
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        return ready, rss_mib(proc.pid), max(rss_mib(int(c)) for c in children)  # the worker is the largest child
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--baseline", type=Path, help="another checkout of ringserve to measure beside this one")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "tiny"
            subprocess.run([sys.executable, "-m", "server.cli", "make-model", str(model), "--preset", "tiny"],
                           cwd=ROOT, check=True, capture_output=True)
        print(f"serve start-up, {model.name}, {cpu_model()}, medians of {args.runs}")
        print(f"{'checkout':<12} {'to /ready s':>12} {'front RSS MiB':>14} {'worker RSS MiB':>15}")
        rows = [("this", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
        for label, checkout in rows:
            runs = [measure(checkout, model) for _ in range(args.runs)]
            ready, front, worker = (statistics.median(col) for col in zip(*runs))
            print(f"{label:<12} {ready:12.2f} {front:14.1f} {worker:15.1f}")


if __name__ == "__main__":
    main()
