"""ringserve vs the transformers peer (`perf/peer_server.py`) on the same model and workload.

    python perf/compare_peer.py [--model-dir DIR] [--concurrency 1,2,4] [--workload fixed|agentx]
                                [--input-len 128 --output-len 32] [--out-dir DIR] [-- SERVE_FLAGS...]

Makes the `small` model when no directory is given (`python -m server.cli make-model DIR --preset
small`), starts `python -m server.cli serve MODEL_DIR --port P` and the peer, runs `bench serve`
against each at every concurrency, then prints output tok/s and p90 per-user tok/s with the
ringserve/peer ratios, and writes each run's JSON plus `compare.png` to --out-dir. Both servers
get the same thread count (OMP_NUM_THREADS, ringserve's --threads-per-worker unless given after
`--`, the peer's --threads). Exits 2 with one
line if `ringserve serve` does not exist yet or a server does not come up.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from perf.serving import bench, cli, plot, report  # noqa: E402


class CompareError(Exception):
    pass


def _has_serve() -> bool:
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--help"], cwd=REPO,
                       capture_output=True, text=True)
    return r.returncode == 0


def _wait_up(url: str, proc: subprocess.Popen, name: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise CompareError(f"{name} exited with status {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise CompareError(f"{name} did not answer {url}/v1/models within {timeout_s:.0f} s")


def _start(cmd: list[str], log: Path, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _bench(url: str, label: str, c: int, a: argparse.Namespace) -> dict:
    argv = ["serve", "--url", url, "--label", label, "--workload", a.workload, "--max-concurrency", str(c),
            "--num-prompts", str(a.prompts_per_concurrency * c), "--num-warmups", str(c), "--ignore-eos",
            "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--seed", str(a.seed),
            "--num-sessions", str(2 * c), "--think-time-scale", str(a.think_time_scale), "--disable-tqdm"]
    args = cli.build_parser().parse_args(argv)
    return asyncio.run(bench.run_one(args))


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:6.2f}x" if a and b else "   n/a"


def compare(a: argparse.Namespace, serve_flags: list[str]) -> int:
    if not _has_serve():
        raise CompareError("`python -m server.cli serve` does not exist yet (the lead is adding it to "
                           "server/cli.py); nothing to compare against")
    out = Path(a.out_dir or tempfile.mkdtemp(prefix="compare-peer-"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir = a.model_dir
    if model_dir is None:
        model_dir = str(Path(tempfile.mkdtemp(prefix="ringserve-small-")))
        subprocess.run([sys.executable, "-m", "server.cli", "make-model", model_dir, "--preset", "small"],
                       cwd=REPO, check=True)
    if "--threads-per-worker" not in serve_flags:
        serve_flags = [*serve_flags, "--threads-per-worker", str(a.threads)]
    ring_url, peer_url = f"http://127.0.0.1:{a.ringserve_port}", f"http://127.0.0.1:{a.peer_port}"
    procs = [
        _start([sys.executable, "-m", "server.cli", "serve", model_dir, "--port", str(a.ringserve_port), *serve_flags],
               out / "ringserve.log", a.threads),
        _start([sys.executable, str(REPO / "perf" / "peer_server.py"), model_dir, "--port", str(a.peer_port),
                "--threads", str(a.threads)], out / "peer.log", a.threads),
    ]
    try:
        _wait_up(ring_url, procs[0], "ringserve serve", a.startup_timeout)
        _wait_up(peer_url, procs[1], "peer server", a.startup_timeout)
        docs = []
        print(f"{'c':>4} {'ringserve tok/s':>16} {'peer tok/s':>11} {'ratio':>7} "
              f"{'ring p90 tok/s/user':>20} {'peer p90':>9} {'ratio':>7}")
        for c in [int(x) for x in a.concurrency.split(",")]:
            r, p = _bench(ring_url, "ringserve", c, a), _bench(peer_url, "peer", c, a)
            for d in (r, p):
                report.write_document(d, out / f"{d['label']}_c{c}.json")
                docs.append(d)
            r90 = r["interactivity_tok_s_per_user"]["p90"]
            p90 = p["interactivity_tok_s_per_user"]["p90"]
            print(f"{c:>4} {r['output_throughput']:>16.1f} {p['output_throughput']:>11.1f} "
                  f"{_ratio(r['output_throughput'], p['output_throughput'])} {r90 or 0:>20.1f} {p90 or 0:>9.1f} "
                  f"{_ratio(r90, p90)}")
        plot.draw(docs, out / "compare.png")
        print(f"results and compare.png in {out}")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_flags = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description="ringserve vs the transformers peer server")
    ap.add_argument("--model-dir", default=None, help="default: a fresh `small` model")
    ap.add_argument("--workload", choices=["fixed", "agentx"], default="fixed")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--prompts-per-concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--think-time-scale", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ringserve-port", type=int, default=18400)
    ap.add_argument("--peer-port", type=int, default=18401)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--out-dir", default=None, help="default: a fresh temporary directory")
    a = ap.parse_args(argv)
    try:
        return compare(a, serve_flags)
    except (CompareError, bench.BenchError, subprocess.CalledProcessError) as exc:
        print(f"compare_peer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
