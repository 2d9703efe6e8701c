"""`ringserve bench {serve,sweep,plot,gen-trace}`: entry point `perf.serving.cli:main(argv)`.

    ringserve bench serve --url http://127.0.0.1:8000 --workload fixed --input-len 8192 --output-len 1024 \
        --range-ratio 0.8 --max-concurrency 64 --num-prompts 640 --num-warmups 128 --ignore-eos --result-file r.json
    ringserve bench serve --url URL --workload agentx --agentx-preset gpu --max-concurrency 32 --ignore-eos
    ringserve bench sweep --url URL1 --label a --url URL2 --label b --concurrency-end 64 --result-dir out/
    ringserve bench gen-trace --url unused --num-sessions 16 --out t.jsonl   # then --workload trace --trace t.jsonl
    ringserve bench serve --url URL --workload trace --trace perf/traces/agentx_example.jsonl --request-shape agentx \
        --max-concurrency 4 --ignore-eos      # AgentX's request shape (perf/serving/conversation.py)

Every user error ends as one line `ringserve bench: error: …` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

from perf.serving import agentx, bench, report, trace, weka

EXIT_USAGE = 2


def _percentiles(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_run_args(p: argparse.ArgumentParser, multi_url: bool = False) -> None:
    """Flags of one run (shared by serve and sweep)."""
    if multi_url:
        p.add_argument("--url", action="append", required=True, help="server base URL; repeat for several")
        p.add_argument("--label", action="append", default=None, help="one per --url (default: the URL)")
    else:
        p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
        p.add_argument("--label", default=None, help="name of this server/configuration in results")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", choices=["fixed", "agentx", "trace"], default="fixed")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="client-side limit on requests in flight (agentx/trace: live session trees)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="fixed: mean arrivals/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (1 = Poisson)")
    p.add_argument("--num-prompts", type=int, default=64, help="fixed: measured requests")
    p.add_argument("--num-warmups", type=int, default=0, help="unmeasured warm-up requests before the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so outputs have the requested length")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-continuous-usage", action="store_true",
                   help="do not ask for per-chunk usage (stream_options.continuous_usage_stats)")
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    p.add_argument("--cache-bust", default=None, help="marker put at the start of prompts (default: random per run)")
    p.add_argument("--request-shape", choices=["flat", "agentx"], default="flat",
                   help="agentx/trace: flat = each turn one user message of its prompt text; agentx = the growing "
                        "chat history with reasoning and tool turns, max_completion_tokens and session headers, "
                        "as AIPerf replays AgentX")
    p.add_argument("--reasoning-share", type=float, default=0.5,
                   help="agentx shape: share of a recorded reply with a reasoning section sent back as "
                        "reasoning_content")
    p.add_argument("--tool-results-as-user", action="store_true",
                   help="agentx shape: tool results as user messages (AIPerf's default) instead of "
                        "assistant tool_calls + tool messages")
    g = p.add_argument_group("fixed workload")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    g = p.add_argument_group("agentx workload (ranges are LO,HI; defaults from --agentx-preset)")
    g.add_argument("--agentx-preset", choices=sorted(agentx.PRESETS), default="cpu")
    g.add_argument("--num-sessions", type=int, default=None, help="session trees to play (trace: first N)")
    for name in ("turns", "first-turn-tokens", "append-tokens", "short-output", "long-output", "think-s",
                 "subagent-turns", "subagent-first-tokens"):
        g.add_argument(f"--{name}", default=None, metavar="LO,HI")
    g.add_argument("--max-context", type=int, default=None)
    g.add_argument("--long-share", type=float, default=None)
    g.add_argument("--fork-prob", type=float, default=None)
    g.add_argument("--max-subagents", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None, help="tokens per hash block (default 64)")
    g.add_argument("--tool-use-share", type=float, default=None, help="share of non-final turns ending in a tool call")
    g.add_argument("--thinking-share", type=float, default=None, help="share of replies with a reasoning section")
    g.add_argument("--think-time-scale", type=float, default=1.0, help="multiply every think time")
    g.add_argument("--duration", type=float, default=None, help="stop sending new turns after this many seconds")
    g.add_argument("--trace", default=None, help="--workload trace: JSONL file (see perf/serving/trace.py)")
    g = p.add_argument_group("reporting")
    g.add_argument("--num-gpus", type=float, default=1.0, help="GPUs (CPU: workers) behind the URL, for per-GPU rates")
    g.add_argument("--gpu-hour-usd", type=float, default=38.96)
    g.add_argument("--metric-percentiles", type=_percentiles, default=[50.0, 90.0, 99.0])
    g.add_argument("--goodput", default=None, help="SLOs in ms, e.g. ttft:500,tpot:50")
    g.add_argument("--metrics-interval", type=float, default=2.0, help="seconds between /metrics samples")
    g.add_argument("--save-detailed", action="store_true", help="add per-request rows to the result file")
    g.add_argument("--disable-tqdm", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringserve bench", description="serving benchmark client")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="one benchmark run against one server")
    add_run_args(p)
    p.add_argument("--result-file", default=None, help="write the result document (JSON) here")
    p.set_defaults(func=_cmd_serve)
    p = sub.add_parser("sweep", help="double concurrency per server and plot tok/s/GPU vs tok/s/user")
    add_run_args(p, multi_url=True)
    p.add_argument("--concurrency-start", type=int, default=1)
    p.add_argument("--concurrency-end", type=int, default=8)
    p.add_argument("--prompts-per-concurrency", type=int, default=10, help="fixed: num_prompts = this × c")
    p.add_argument("--warmups-per-concurrency", type=int, default=2, help="num_warmups = this × c")
    p.add_argument("--sessions-per-concurrency", type=int, default=2, help="agentx: num_sessions = this × c")
    p.add_argument("--result-dir", required=True)
    p.add_argument("--y-metric", choices=["output", "total"], default="output")
    p.add_argument("--x-percentile", type=float, default=50.0, help="interactivity percentile on the x axis")
    p.set_defaults(func=_cmd_sweep)
    p = sub.add_parser("plot", help="draw the sweep picture from result documents")
    p.add_argument("results", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--y-metric", choices=["output", "total"], default="output")
    p.add_argument("--x-percentile", type=float, default=50.0)
    p.set_defaults(func=_cmd_plot)
    p = sub.add_parser("gen-trace", help="write the synthetic AgentX-like workload as a JSONL trace")
    add_run_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=["flat", "weka", "weka-dir"], default="flat",
                   help="flat: one request per line; weka: AIPerf's AgentX trace format, one trace per line; "
                        "weka-dir: a directory of per-trace .json files (aiperf --custom-dataset-type weka_trace)")
    p.set_defaults(func=_cmd_gen_trace)
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    doc = asyncio.run(bench.run_one(args))
    report.print_table(doc, sys.stdout, args.metric_percentiles)
    if args.result_file:
        report.write_document(doc, args.result_file)
        print(f"result written to {args.result_file}")
    return 0 if doc["completed"] > 0 else 1


def _cmd_sweep(args: argparse.Namespace) -> int:
    from perf.serving import sweep

    png = sweep.run_sweep(args)
    print(f"plot written to {png}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from perf.serving import plot

    docs = [plot.load(p) for p in args.results]
    plot.draw(docs, args.out, y_metric=args.y_metric, x_percentile=args.x_percentile)
    print(f"plot written to {args.out}")
    return 0


def _cmd_gen_trace(args: argparse.Namespace) -> int:
    p = bench.agentx_params(args)
    trees = agentx.generate(p)
    if args.format == "flat":
        trace.write_trace(args.out, trees)
    else:
        weka.write_weka(args.out, trees, p.block_size, as_dir=args.format == "weka-dir")
    n = sum(len(t.all_requests()) for t in trees)
    print(f"wrote {n} requests in {len(trees)} session trees to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run `ringserve bench …`; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "label", None) and isinstance(args.label, list) and len(args.label) != len(args.url):
        parser.error("give one --label per --url")
    try:
        return args.func(args)
    except (bench.BenchError, ValueError, OSError) as exc:
        print(f"ringserve bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
