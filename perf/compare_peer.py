"""ringserve vs a peer server on the same model and workload: transformers or llama.cpp's llama-server.

    python perf/compare_peer.py [--peer transformers|llama.cpp] [--model-dir DIR | --geometry NAME]
                                [--concurrency 1,2,4]
                                [--workload fixed|agentx] [--endpoint chat|completions]
                                [--input-len 128 --output-len 32] [--out-dir DIR] [-- SERVE_FLAGS...]

Makes a model when no directory is given (transformers peer: `make-model DIR --preset small`;
llama.cpp peer: the tiny V4 --geometry of perf/peer_llamacpp.py, by default the 6-layer FP8/FP4
`small6`), starts `python -m server.cli serve MODEL_DIR --port P`, runs `bench serve` against it at every concurrency and
stops it, then does the same with the peer (same seed, lengths and `ignore_eos`, so both decode
the same number of tokens; one server at a time, so an idle one takes no cores), prints output
tok/s, median TPOT and TTFT and p90 per-user tok/s side by side with the ringserve/peer ratios,
and writes each run's JSON plus `compare.png` to --out-dir. The transformers peer is
perf/peer_server.py; the llama.cpp peer is built from the llama-cpp-python sdist and fed a GGUF
from llama.cpp's own converter at benchmark time (perf/peer_llamacpp.py, cached under
--cache-dir), never a ringserve dependency. Both servers get the same thread count
(OMP_NUM_THREADS, ringserve's --threads-per-worker unless given after `--`, the peer's threads).
Exits 2 with one line if `ringserve serve` does not exist, the peer cannot be built, or a server
does not come up (a peer that fails after ringserve was measured still gets ringserve's table,
its own cells n/a). --server-env sets a variable for both servers, --ringserve-env for ringserve
only. Mind OpenMP's wait policy: at their defaults both servers' threads spin a while between
parallel regions (ringserve's CPU workers give threads up while other processes keep cores busy,
engine/core_share.py), so compare them at their defaults; `--server-env OMP_WAIT_POLICY=PASSIVE`
makes llama.cpp sleep at every op's barrier (4× slower on the issue41 geometry on a 2-core EPYC),
not a fair race.
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

from perf import peer_llamacpp  # noqa: E402
from perf.serving import bench, cli, plot, report  # noqa: E402
from perf.machine import cpu_model  # noqa: E402


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


def _start(cmd: list[str], log: Path, threads: int, extra_env: dict[str, str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO), **extra_env}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def prompts_at(a: argparse.Namespace, c: int) -> int:
    """Requests at concurrency `c`: from --num-prompts (one count, or one per --concurrency level)
    or --prompts-per-concurrency × c."""
    if not a.num_prompts:
        return a.prompts_per_concurrency * c
    counts = [int(x) for x in a.num_prompts.split(",")]
    if len(counts) == 1:
        return counts[0]
    levels = [int(x) for x in a.concurrency.split(",")]
    if len(counts) != len(levels):
        raise CompareError(f"--num-prompts has {len(counts)} counts for {len(levels)} concurrency levels")
    return counts[levels.index(c)]


def _bench(url: str, label: str, c: int, a: argparse.Namespace) -> dict:
    argv = ["serve", "--url", url, "--label", label, "--workload", a.workload, "--endpoint", a.endpoint,
            "--max-concurrency", str(c),
            "--num-prompts", str(prompts_at(a, c)), "--num-warmups", str(c),
            "--ignore-eos",
            "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--seed", str(a.seed),
            "--num-sessions", str(2 * c), "--think-time-scale", str(a.think_time_scale), "--disable-tqdm"]
    args = cli.build_parser().parse_args(argv)
    return asyncio.run(bench.run_one(args))


PEERS = ("transformers", "llama.cpp")
# (document key, column title, format): ratio columns are always ringserve / peer.
COLUMNS = (("output_throughput", "out tok/s", "{:.1f}"), ("tpot_ms", "TPOT ms p50", "{:.2f}"),
           ("ttft_ms", "TTFT ms p50", "{:.1f}"), ("interactivity_tok_s_per_user", "tok/s/user p90", "{:.1f}"))


def _metric(doc: dict, key: str) -> float | None:
    v = doc.get(key)
    if isinstance(v, dict):
        v = v.get("p90" if key == "interactivity_tok_s_per_user" else "p50")
    return float(v) if isinstance(v, (int, float)) else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def _fmt(fmt: str, v: float | None) -> str:
    return "n/a" if v is None else fmt.format(v)


def table_header() -> str:
    cells = [f"{'c':>3}"]
    for _, title, _ in COLUMNS:
        cells += [f"{'ring ' + title:>19}", f"{'peer ' + title:>19}", f"{'ratio':>7}"]
    return " ".join(cells)


def table_row(c: int, ring: dict, peer: dict) -> str:
    cells = [f"{c:>3}"]
    for key, _, fmt in COLUMNS:
        r, p = _metric(ring, key), _metric(peer, key)
        cells += [f"{_fmt(fmt, r):>19}", f"{_fmt(fmt, p):>19}", f"{_ratio(r, p):>7}"]
    return " ".join(cells)


def _make_model(a: argparse.Namespace) -> str:
    model_dir = str(Path(tempfile.mkdtemp(prefix=f"ringserve-{a.peer.replace('.', '')}-")))
    if a.peer == "llama.cpp":
        cmd = [sys.executable, str(REPO / "perf" / "peer_llamacpp.py"), "make-model", model_dir, "--seed", str(a.seed),
               "--geometry", a.geometry]
    else:
        cmd = [sys.executable, "-m", "server.cli", "make-model", model_dir, "--preset", "small"]
    subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return model_dir


def peer_command(a: argparse.Namespace, model_dir: str, slots: int) -> tuple[list[str], str]:
    """The peer's command line and a one-line description (builds/converts for llama.cpp)."""
    if a.peer == "transformers":
        return ([sys.executable, str(REPO / "perf" / "peer_server.py"), model_dir, "--port", str(a.peer_port),
                 "--threads", str(a.threads)], "transformers (perf/peer_server.py, one request at a time)")
    cache = Path(a.cache_dir)
    binary = peer_llamacpp.build_server(cache, a.build_jobs)
    gguf = peer_llamacpp.convert_model(cache, Path(model_dir))
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    line = next((ln for ln in (version.stdout + version.stderr).splitlines() if ln.startswith("version")), "")
    cmd = peer_llamacpp.server_command(binary, gguf, a.peer_port, a.threads, slots, a.ctx_per_slot,
                                       Path(model_dir).name)
    return cmd, f"llama.cpp llama-server ({line or 'version unknown'}; {slots} slots; {gguf.name})"


def server_env(a: argparse.Namespace, ringserve: bool = False) -> dict[str, str]:
    """The KEY=VALUE pairs of --server-env (both servers) and, for ringserve, --ringserve-env."""
    env = {}
    for item in a.server_env + (a.ringserve_env if ringserve else []):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CompareError(f"--server-env and --ringserve-env take KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve_and_bench(cmd: list[str], log: Path, url: str, label: str, levels: list[int],
                     a: argparse.Namespace, env: dict[str, str]) -> dict[int, dict]:
    """Start one server, bench it at every concurrency, stop it: the other server is not running
    meanwhile, so an idle server's threads never take cores from the one being measured."""
    proc = _start(cmd, log, a.threads, env)
    docs = {}
    try:
        _wait_up(url, proc, label, a.startup_timeout)
        for c in levels:
            docs[c] = _bench(url, label, c, a)
            report.write_document(docs[c], log.parent / f"{label}_c{c}.json")
            print(f"{label} c={c}: {docs[c]['output_throughput']:.1f} output tok/s", file=sys.stderr, flush=True)
        return docs
    finally:
        _stop([proc])


def compare(a: argparse.Namespace, serve_flags: list[str]) -> int:
    if not _has_serve():
        raise CompareError("`python -m server.cli serve` does not exist yet (the lead is adding it to "
                           "server/cli.py); nothing to compare against")
    server_env(a, ringserve=True)                       # a malformed pair fails before any server starts
    out = Path(a.out_dir or tempfile.mkdtemp(prefix="compare-peer-"))
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in a.concurrency.split(",")]
    model_dir = a.model_dir or _make_model(a)
    peer_cmd, peer_desc = peer_command(a, model_dir, max(levels))
    if "--threads-per-worker" not in serve_flags:
        serve_flags = [*serve_flags, "--threads-per-worker", str(a.threads)]
    ring_cmd = [sys.executable, "-m", "server.cli", "serve", model_dir, "--port", str(a.ringserve_port), *serve_flags]
    ring = _serve_and_bench(ring_cmd, out / "ringserve.log", f"http://127.0.0.1:{a.ringserve_port}", "ringserve",
                            levels, a, server_env(a, ringserve=True))
    peer_error = None
    try:
        peer = _serve_and_bench(peer_cmd, out / "peer.log", f"http://127.0.0.1:{a.peer_port}", a.peer, levels, a,
                                server_env(a))
    except CompareError as exc:                         # ringserve's side is still worth its table
        peer, peer_error = {}, str(exc)
    per_level = "requests " + ",".join(f"{prompts_at(a, c)} at c={c}" for c in levels)
    print(f"# {cpu_model()}; {a.threads} threads per server; model {model_dir}; load {_load()}")
    print(f"# peer: {peer_desc}" + (f"; FAILED: {peer_error} (see {out / 'peer.log'})" if peer_error else ""))
    if a.server_env:
        print(f"# both servers' environment: {' '.join(a.server_env)}")
    if a.ringserve_env:
        print(f"# ringserve's environment: {' '.join(a.ringserve_env)}")
    print(f"# workload {a.workload}, endpoint {a.endpoint}, input {a.input_len}, output {a.output_len} "
          f"(ignore_eos), {per_level}; ratio = ringserve/peer")
    print(table_header())
    docs = []
    for c in levels:
        docs += [ring[c]] + ([peer[c]] if c in peer else [])
        print(table_row(c, ring[c], peer.get(c, {})))
    plot.draw(docs, out / "compare.png")
    print(f"results and compare.png in {out}")
    return 2 if peer_error else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_flags = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description="ringserve vs a peer server (transformers or llama.cpp)")
    ap.add_argument("--peer", choices=PEERS, default="transformers")
    ap.add_argument("--model-dir", default=None, help="default: a fresh model made for the peer")
    ap.add_argument("--geometry", choices=list(peer_llamacpp.GEOMETRIES), default="small6",
                    help="the tiny V4 made for the llama.cpp peer when no --model-dir is given "
                         "(perf/peer_llamacpp.py GEOMETRIES)")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument("--workload", choices=["fixed", "agentx"], default="fixed")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--prompts-per-concurrency", type=int, default=8)
    ap.add_argument("--num-prompts", default=None,
                    help="requests per level: N, or N1,N2,... per --concurrency level "
                         "(default: --prompts-per-concurrency × concurrency)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--think-time-scale", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ringserve-port", type=int, default=18400)
    ap.add_argument("--peer-port", type=int, default=18401)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--out-dir", default=None, help="default: a fresh temporary directory")
    ap.add_argument("--cache-dir", default=str(peer_llamacpp.DEFAULT_CACHE),
                    help="llama.cpp sdist, build and GGUF cache (llama.cpp peer)")
    ap.add_argument("--build-jobs", type=int, default=2, help="ninja jobs for building llama-server")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for both servers (repeatable)")
    ap.add_argument("--ringserve-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for ringserve only (repeatable), e.g. OMP_WAIT_POLICY=PASSIVE "
                         "to make its worker threads sleep at once between parallel regions")
    ap.add_argument("--ctx-per-slot", type=int, default=1024, help="llama-server context per parallel slot")
    a = ap.parse_args(argv)
    try:
        return compare(a, serve_flags)
    except (CompareError, peer_llamacpp.PeerBuildError, bench.BenchError, subprocess.CalledProcessError) as exc:
        print(f"compare_peer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
