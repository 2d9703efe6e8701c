"""`bench sweep`: for every server, double the concurrency from start to end, one run each.

Run c writes `<result-dir>/<label>_c<c>.json`; after all runs `sweep.png` (see `plot`) and
`sweep_summary.json` (one row per run) land in the same directory. Per run: fixed workload
num_prompts = prompts-per-concurrency × c, agentx num_sessions = sessions-per-concurrency × c,
warm-ups = warmups-per-concurrency × c (InferenceX uses 10× and 2×).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import re
from collections.abc import Callable
from pathlib import Path

from perf.serving import bench, plot, report


def concurrencies(start: int, end: int) -> list[int]:
    """start, 2·start, 4·start … ≤ end."""
    if start < 1 or end < start:
        raise ValueError("need 1 ≤ --concurrency-start ≤ --concurrency-end")
    out, c = [], start
    while c <= end:
        out.append(c)
        c *= 2
    return out


def safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "server"


def run_args(args: argparse.Namespace, url: str, label: str, c: int) -> argparse.Namespace:
    """The `serve` arguments of one sweep point."""
    ns = copy.copy(args)
    ns.url, ns.label, ns.max_concurrency = url, label, c
    ns.num_prompts = args.prompts_per_concurrency * c
    ns.num_warmups = args.warmups_per_concurrency * c
    if args.workload == "agentx":
        ns.num_sessions = args.sessions_per_concurrency * c
    return ns


def summary_row(doc: dict) -> dict:
    keys = ("label", "max_concurrency", "output_throughput", "output_throughput_per_gpu",
            "total_token_throughput_per_gpu", "interactivity_tok_s_per_user", "ttft_ms", "tpot_ms",
            "cost_per_million_output_tokens_usd", "completed", "failed")
    return {k: doc.get(k) for k in keys}


def run_sweep(args: argparse.Namespace, on_result: Callable[[dict, Path], None] | None = None) -> Path:
    """Run every (server, concurrency) point; returns the PNG path."""
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = args.label or args.url
    docs = []
    for url, label in zip(args.url, labels):
        for c in concurrencies(args.concurrency_start, args.concurrency_end):
            doc = asyncio.run(bench.run_one(run_args(args, url, label, c)))
            path = out_dir / f"{safe_name(label)}_c{c}.json"
            report.write_document(doc, path)
            docs.append(doc)
            if on_result:
                on_result(doc, path)
    (out_dir / "sweep_summary.json").write_text(json.dumps([summary_row(d) for d in docs], indent=2) + "\n")
    png = out_dir / "sweep.png"
    plot.draw(docs, png, y_metric=args.y_metric, x_percentile=args.x_percentile)
    return png
