"""`ringserve bench serve` through the PD proxy vs against one colocated server, side by side.

Starts (on loopback, NIXL over UCX tcp) a `--kv-role prefill` server, a `--kv-role decode`
server and `ringserve proxy` in front of them, plus a plain colocated `ringserve serve` of the
same model, then runs the project's own benchmark client (`ringserve bench serve`, fixed
workload, streamed completions) against the proxy and the colocated server at each
concurrency, alternating the two so both see the same machine load (`--repeats N`: N
alternations; each figure is then the median of its N runs, with the spread min–max, since on a
shared machine one run of the same setup can differ from the next by 2–3×). Prints TTFT p50,
TPOT p50 and output tok/s for each, and PD / colocated ratios of the same run.

The PD pair uses two processes (two workers) where the colocated server uses one: on a machine
with fewer free cores than workers the pair competes with itself, so read the ratio together
with the header's core count.

Run: ``python perf/bench_pd_serving.py [MODEL_DIR] [--concurrency 1 4 16] [--num-prompts 16]
[--input-len 128] [--output-len 32] [--repeats 1] [--json OUT]`` (a tiny model is made without MODEL_DIR).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from perf.bench_pd import ENV, Proc  # noqa: E402  (server processes on loopback, UCX env)
from perf.machine import cpu_model  # noqa: E402

_SETUPS = ("colocated", "pd")
_FIGURES = ("ttft_p50_ms", "tpot_p50_ms", "output_tok_s")


def bench(url: str, label: str, c: int, args: argparse.Namespace, out: Path) -> dict:
    """One `ringserve bench serve` run; the numbers of its result document that we report."""
    n = max(args.num_prompts, c)  # at least one request per slot
    cmd = [sys.executable, "-m", "server.cli", "bench", "serve", "--url", url, "--label", label,
           "--endpoint", "completions", "--workload", "fixed", "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--range-ratio", "0", "--num-prompts", str(n),
           "--num-warmups", "1", "--max-concurrency", str(c), "--ignore-eos", "--temperature", "0",
           "--disable-tqdm", "--result-file", str(out)]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"bench against {label} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    doc = json.loads(out.read_text())
    # input tokens equal on both setups = the client tokenized through the proxy like the server
    return {"setup": label, "concurrency": c, "requests": n, "failed": doc.get("failed"),
            "input_tokens": doc["total_input_tokens"], "output_tokens": doc["total_output_tokens"],
            "ttft_p50_ms": doc["ttft_ms"]["p50"], "tpot_p50_ms": doc["tpot_ms"]["p50"],
            "output_tok_s": doc["output_throughput"]}


def start(model_dir: Path, max_seqs: int, tmp: Path) -> dict[str, Proc]:
    common = [str(model_dir), "--kv-cache-memory", "0.1", "--block-size", "16", "--threads-per-worker", "1",
              "--max-num-seqs", str(max_seqs), "--served-model-name", "m"]
    procs = {"prefill": Proc("prefill", ["serve", *common, "--kv-role", "prefill", "--kv-transfer", "nixl"], tmp),
             "decode": Proc("decode", ["serve", *common, "--kv-role", "decode", "--kv-transfer", "nixl"], tmp),
             "colocated": Proc("colocated", ["serve", *common], tmp)}
    for p in procs.values():
        p.wait_ready()
    procs["proxy"] = Proc("proxy", ["proxy", "--prefill", procs["prefill"].url, "--decode", procs["decode"].url],
                          tmp)
    procs["proxy"].wait_ready()
    return procs


def combine(runs: list[dict]) -> dict:
    """Repeats of one (setup, concurrency): the median of each figure, and its min and max."""
    out = dict(runs[0], repeats=len(runs))
    for k in _FIGURES:
        values = [r[k] for r in runs]
        out[k], out[k + "_range"] = statistics.median(values), (min(values), max(values))
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'conc':>4} {'setup':>9} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'out tok/s':>10}   "
          f"{'PD/colo TTFT':>12} {'TPOT':>6} {'tok/s':>6}   spread over repeats (min-max)")
    by = {(r["concurrency"], r["setup"]): r for r in rows}
    for c in sorted({r["concurrency"] for r in rows}):
        col, pd = by[(c, "colocated")], by[(c, "pd")]
        for r in (col, pd):
            ratio = " " * 28
            if r is pd:
                ratio = " ".join(f"{pd[k] / col[k]:>{w}.2f}" for k, w in zip(_FIGURES, (12, 6, 6)))
            spread = "  ".join(f"{lo:.0f}-{hi:.0f}" if k != "output_tok_s" else f"{lo:.1f}-{hi:.1f}"
                               for k in _FIGURES for lo, hi in [r[k + "_range"]])
            print(f"{c:>4} {r['setup']:>9} {r['ttft_p50_ms']:>12.1f} {r['tpot_p50_ms']:>12.1f} "
                  f"{r['output_tok_s']:>10.1f}   {ratio}   {spread}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", nargs="?", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1, help="alternations of the two setups per concurrency")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-pd-serving-"))
    model_dir = Path(args.model_dir) if args.model_dir else tmp / "tiny"
    if args.model_dir is None:
        subprocess.run([sys.executable, "-m", "server.cli", "make-model", str(model_dir), "--preset", "tiny",
                        "--seed", "3"], check=True, capture_output=True)
    print(f"# bench_pd_serving — {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores; model {model_dir.name}; "
          f"fixed workload, input {args.input_len} / output {args.output_len} tokens, ≥ {args.num_prompts} "
          f"requests per run, {args.repeats} run(s) per setup; load average {os.getloadavg()[0]:.1f}; "
          f"NIXL over UCX {ENV['UCX_TLS']} on {ENV['UCX_NET_DEVICES']}", flush=True)
    procs = start(model_dir, max(4, max(args.concurrency)), tmp)
    runs, rows = [], []
    try:
        for c in args.concurrency:
            for i in range(args.repeats):
                for setup in _SETUPS:
                    url = procs["proxy" if setup == "pd" else "colocated"].url
                    runs.append(dict(bench(url, setup, c, args, tmp / f"{setup}-c{c}-{i}.json"), repeat=i))
                    print(json.dumps(runs[-1]), flush=True)
            rows += [combine([r for r in runs if r["concurrency"] == c and r["setup"] == s]) for s in _SETUPS]
    finally:
        for p in reversed(list(procs.values())):
            p.stop()
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "args": vars(args), "runs": runs,
                                               "summary": rows}, indent=1))


if __name__ == "__main__":
    main()
