"""The result document of one run (one JSON object) and its readable table."""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from perf.serving import metrics
from perf.serving.prom_metrics import server_metrics
from perf.serving.runner import RunResult

SCHEMA = "ringserve-bench-serve/1"


def build_document(result: RunResult, config: dict[str, Any], *, num_gpus: float, gpu_hour_usd: float,
                   percentiles: Sequence[float], block_size: int, goodput_slo_ms: dict[str, float] | None = None,
                   detailed: bool = False) -> dict[str, Any]:
    """Config + client metrics + server metrics + ideal/achieved prefix-hit rates."""
    recs = result.records
    doc: dict[str, Any] = {"schema": SCHEMA, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    doc.update(config)
    doc.update(metrics.compute(recs, result.end_s - result.start_s, result.start_s, num_gpus=num_gpus,
                               gpu_hour_usd=gpu_hour_usd, percentiles=percentiles, goodput_slo_ms=goodput_slo_ms))
    doc.update(server_metrics(result.metrics_before, result.metrics_after, result.dp_samples))
    ordered = sorted((r for r in recs if r.spec.hash_ids), key=lambda r: r.send_s)
    if ordered:
        hits, total = metrics.ideal_prefix_hit_tokens(((r.spec.hash_ids, r.spec.input_length) for r in ordered), block_size)
        doc["ideal_prefix_hit_rate"] = hits / total if total else None
    else:
        doc["ideal_prefix_hit_rate"] = None
    doc["num_sessions_started"] = len({r.spec.session_id.split(".")[0] for r in recs if r.spec.session_id}) or None
    doc["warmup_failures"] = result.warmup_failures
    doc["errors"] = sorted({r.error for r in recs if not r.ok})[:10]
    if detailed:
        doc["requests"] = [_request_row(r) for r in recs]
    return _json_safe(doc)


def _request_row(r) -> dict[str, Any]:
    tpot = metrics.tpot_s(r)
    return {"session_id": r.spec.session_id, "turn": r.spec.turn, "ok": r.ok, "input_tokens": r.input_tokens,
            "output_tokens": r.output_tokens, "queue_ms": r.queue_s * 1e3,
            "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1e3, "tpot_ms": None if tpot is None else tpot * 1e3,
            "e2el_ms": r.e2el_s * 1e3, "chunks": len(r.chunk_times), "cached_tokens": r.cached_tokens,
            "reasoning_tokens": r.reasoning_tokens}


def _json_safe(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_document(doc: dict[str, Any], path: str | Path) -> None:
    """Write one JSON document (creating parent directories)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2) + "\n")


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def print_table(doc: dict[str, Any], out: TextIO, percentiles: Sequence[float]) -> None:
    """The vLLM-style summary table."""
    w = 50

    def row(name: str, v: Any, nd: int = 2) -> None:
        out.write(f"{name:<{w}}{_fmt(v, nd):>14}\n")

    out.write(f"{' Serving Benchmark Result ':=^{w + 14}}\n")
    shape = " (agentx shape)" if doc.get("request_shape") == "agentx" else ""
    row("Server / workload", f"{doc.get('label')} / {doc.get('workload')}{shape}")
    row("Max concurrency", doc.get("max_concurrency"))
    row("Successful requests", doc["completed"])
    row("Failed requests", doc["failed"])
    row("Benchmark duration (s)", doc["duration_s"])
    row("Total input tokens", doc["total_input_tokens"])
    row("Total generated tokens", doc["total_output_tokens"])
    row("Request throughput (req/s)", doc["request_throughput"])
    row("Output token throughput (tok/s)", doc["output_throughput"])
    row("Peak output token throughput (tok/s)", doc["peak_output_throughput"])
    row("Peak concurrent requests", doc["peak_concurrent_requests"])
    row("Total token throughput (tok/s)", doc["total_token_throughput"])
    row(f"Output tok/s per GPU ({_fmt(doc['num_gpus'], 0)} GPU)", doc["output_throughput_per_gpu"])
    row("Total tok/s per GPU", doc["total_token_throughput_per_gpu"])
    if "request_goodput" in doc:
        row("Request goodput (req/s)", doc["request_goodput"])
    for key, title in (("ttft_ms", "Time to First Token (from send)"), ("queue_ms", "Client-side slot wait"),
                       ("ttft_from_ready_ms", "TTFT incl. slot wait"),
                       ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency (per token)"), ("e2el_ms", "End-to-end Latency")):
        out.write(f"{' ' + title + ' ':-^{w + 14}}\n")
        s = doc[key]
        row(f"Mean {key[:-3].upper()} (ms)", s["mean"])
        for p in percentiles:
            row(f"P{p:g} {key[:-3].upper()} (ms)", s.get(metrics.pkey(p)))
    out.write(f"{' Interactivity (tok/s/user = 1000/TPOT) ':-^{w + 14}}\n")
    for p in sorted(set(percentiles) | {50.0, 90.0}):
        row(f"P{p:g} interactivity (tok/s/user)", doc["interactivity_tok_s_per_user"].get(metrics.pkey(p)))
    out.write(f"{' Server ':-^{w + 14}}\n")
    row("Spec. acceptance length", doc["spec_acceptance_length"])
    row("Spec. acceptance rate", doc["spec_acceptance_rate"], 3)
    pos = doc.get("spec_per_position_acceptance")
    row("Spec. per-position acceptance", None if pos is None else " ".join(f"{x:.2f}" for x in pos))
    row("Ideal prefix-hit rate", doc["ideal_prefix_hit_rate"], 3)
    row("Achieved prefix-hit rate", doc["achieved_prefix_hit_rate"], 3)
    row("Usage prefix-hit rate (cached_tokens)", doc.get("usage_prefix_hit_rate"), 3)
    by_turn = doc.get("usage_prefix_hit_rate_by_turn") or {}
    later = doc.get("usage_prefix_hit_rate_later_turns")
    row("  turn 0 / later turns", f"{_fmt(by_turn.get('0'), 3)} / {_fmt(later, 3)}")
    row("Reasoning tokens (share of output)",
        None if doc.get("total_reasoning_tokens") is None
        else f"{doc['total_reasoning_tokens']} ({_fmt(doc.get('reasoning_token_share'), 2)})")
    row("Token counts from server usage", doc.get("server_token_counts"))
    row("Preemptions", doc["num_preemptions"])
    row("DP imbalance (mean / max)", f"{_fmt(doc['dp_imbalance_mean'])} / {_fmt(doc['dp_imbalance_max'])}")
    row(f"Cost per 1M output tokens (USD @ {doc['gpu_hour_usd']}/GPU-h)", doc["cost_per_million_output_tokens_usd"])
    out.write("=" * (w + 14) + "\n")
    for e in doc.get("errors") or []:
        out.write(f"error: {e}\n")
