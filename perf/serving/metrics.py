"""Serving metrics, defined as `vllm bench serve` and InferenceX define them.

Per request (times from `RequestRecord`, N = output tokens from the server's usage):

* TTFT = first token-carrying chunk − send. Server-side queueing is inside it; the wait for a
  client-side concurrency slot is NOT (it is reported separately as `queue_ms`, and
  `ttft_from_ready_ms` = queue + TTFT is what a user arriving at `ready_s` would see).
* E2EL = end of stream − send.
* TPOT = (E2EL − TTFT) / (N − 1), excluding the first token; undefined for N ≤ 1.
* ITL: one sample per token after the first chunk. A chunk of k tokens arriving g seconds after
  the previous chunk contributes k samples of g/k (speculative decoding streams several tokens
  per chunk; one sample of g would overstate per-token latency k-fold). Tokens that arrive in
  the first chunk with the first token get no sample. Hence sum(ITL) = t_last_chunk − t_first
  and mean ITL ≈ TPOT. When chunk counts are unknown (no per-chunk usage or logprobs) and the
  usage total N exceeds the chunk count, the surplus is apportioned evenly over chunks 2..C.
* Interactivity (tok/s per user) at percentile p = 1000 / TPOT_ms at p; so "p90
  interactivity" is the slow tail (the 90th-percentile TPOT). E2E interactivity likewise from
  E2EL/N.

Run level: duration = measured start → last request end; throughputs = tokens / duration
(output; total = input + output; input counts cache hits); per GPU = / num_gpus; request
throughput = successful / duration; peak output tok/s = max tokens in any 1-s bin; peak
concurrency = max overlap of [send, end]; cost per 1M output tokens = usd_per_gpu_hour ×
num_gpus / (output tok/s × 3600) × 1e6. Percentiles are numpy's linear interpolation.

From the server's usage (AIPerf's `--use-server-token-count`: token totals are the usage's
whenever it has them; `server_token_counts` says whether every request's did): the usage
prefix-hit rate = Σ cached_tokens / Σ prompt_tokens over requests whose usage reports cached
tokens, also per turn index of their session (turn 0 is a session's cold start); reasoning tokens
= Σ completion_tokens_details.reasoning_tokens, and their share of the output tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from perf.serving.records import RequestRecord

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def pkey(p: float) -> str:
    """'p50', 'p99.9'."""
    return f"p{p:g}"


def summary(values: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict:
    """mean, std and percentiles of `values`; None everywhere when empty."""
    out: dict = {"mean": None, "std": None, **{pkey(p): None for p in percentiles}}
    if len(values) == 0:
        return out
    arr = np.asarray(values, dtype=float)
    out["mean"] = float(arr.mean())
    out["std"] = float(arr.std())
    for p in percentiles:
        out[pkey(p)] = float(np.percentile(arr, p))
    return out


def apportion(chunk_tokens: Sequence[int], total: int | None, exact: bool) -> list[int]:
    """Per-chunk token counts made consistent with the server's usage total.

    Exact counts are kept. Otherwise a surplus `total − sum` is spread as evenly as integers
    allow over chunks 2..C (the first chunk comes from prefill), earlier chunks first.
    """
    counts = list(chunk_tokens)
    if exact or total is None or not counts or total <= sum(counts):
        return counts
    surplus = total - sum(counts)
    targets = list(range(1, len(counts))) or [0]
    base, extra = divmod(surplus, len(targets))
    for j, i in enumerate(targets):
        counts[i] += base + (1 if j < extra else 0)
    return counts


def itl_samples(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Per-token inter-token latencies (seconds); see the module docstring."""
    out: list[float] = []
    for i in range(1, len(chunk_times)):
        k = max(1, int(chunk_tokens[i]))
        gap = chunk_times[i] - chunk_times[i - 1]
        out.extend([gap / k] * k)
    return out


def tpot_s(rec: RequestRecord) -> float | None:
    """(E2EL − TTFT) / (N − 1), None when N ≤ 1 or no first token."""
    n = rec.output_tokens
    if rec.ttft_s is None or n <= 1:
        return None
    return (rec.e2el_s - rec.ttft_s) / (n - 1)


def record_itl_s(rec: RequestRecord) -> list[float]:
    """ITL samples of one request after apportioning its chunk counts."""
    counts = apportion(rec.chunk_tokens, rec.completion_tokens, rec.chunk_tokens_exact)
    return itl_samples(rec.chunk_times, counts)


def peak_output_per_s(records: Iterable[RequestRecord], start_s: float, bin_s: float = 1.0) -> float:
    """Most output tokens that arrived in any `bin_s` bin, per second."""
    bins: dict[int, int] = {}
    for rec in records:
        counts = apportion(rec.chunk_tokens, rec.completion_tokens, rec.chunk_tokens_exact)
        for t, k in zip(rec.chunk_times, counts):
            b = int((t - start_s) // bin_s)
            bins[b] = bins.get(b, 0) + k
    return max(bins.values()) / bin_s if bins else 0.0


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Largest number of [start, end) intervals open at once."""
    spans = list(intervals)
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    live = best = 0
    for _, d in events:
        live += d
        best = max(best, live)
    return best


def inverse_percentiles(ms_summary: dict, percentiles: Sequence[float]) -> dict:
    """tok/s = 1000 / ms at each percentile of a per-token latency summary."""
    out = {}
    for p in percentiles:
        v = ms_summary.get(pkey(p))
        out[pkey(p)] = (1000.0 / v) if v else None
    return out


def ideal_prefix_hit_tokens(requests: Iterable[tuple[Sequence[int], int]], block_size: int) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of an infinite prefix cache over requests in send order.

    A request hits its leading blocks whose hashes some earlier request already sent, stopping
    at the first unseen block (a prefix cache cannot skip a block). Only full blocks count; a
    final partial block is never a hit.
    """
    seen: set[int] = set()
    hits = total = 0
    for hash_ids, length in requests:
        total += length
        full = min(len(hash_ids), length // block_size)
        lead = 0
        while lead < full and hash_ids[lead] in seen:
            lead += 1
        hits += lead * block_size
        seen.update(hash_ids)
    return hits, total


def _ms(values: Iterable[float | None]) -> list[float]:
    return [v * 1000.0 for v in values if v is not None]


def compute(records: Sequence[RequestRecord], duration_s: float, start_s: float, *, num_gpus: float = 1.0,
            gpu_hour_usd: float = 38.96, percentiles: Sequence[float] = DEFAULT_PERCENTILES,
            goodput_slo_ms: dict[str, float] | None = None) -> dict:
    """All client-side metrics of one run as a flat dict of plain numbers and summaries."""
    ok = [r for r in records if r.ok]
    pcts = sorted(set(percentiles) | {50.0, 90.0})
    tpots = [tpot_s(r) for r in ok]
    tpot_ms = summary(_ms(tpots), pcts)
    e2e_per_tok = [r.e2el_s / r.output_tokens for r in ok if r.output_tokens > 0]
    itl = [x for r in ok for x in record_itl_s(r)]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.input_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    out_tps = out_tok / dur
    res = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tps,
        "input_throughput": in_tok / dur,
        "total_token_throughput": (in_tok + out_tok) / dur,
        "num_gpus": num_gpus,
        "output_throughput_per_gpu": out_tps / num_gpus,
        "total_token_throughput_per_gpu": (in_tok + out_tok) / dur / num_gpus,
        "peak_output_throughput": peak_output_per_s(ok, start_s),
        "peak_concurrent_requests": peak_concurrency((r.send_s, r.end_s) for r in records),
        "ttft_ms": summary(_ms(r.ttft_s for r in ok), pcts),
        "ttft_from_ready_ms": summary(_ms(r.queue_s + r.ttft_s for r in ok if r.ttft_s is not None), pcts),
        "queue_ms": summary(_ms(r.queue_s for r in ok), pcts),
        "tpot_ms": tpot_ms,
        "itl_ms": summary(_ms(itl), pcts),
        "e2el_ms": summary(_ms(r.e2el_s for r in ok), pcts),
        "interactivity_tok_s_per_user": inverse_percentiles(tpot_ms, pcts),
        "e2e_interactivity_tok_s_per_user": inverse_percentiles(summary(_ms(e2e_per_tok), pcts), pcts),
        "chunk_counts_exact": all(r.chunk_tokens_exact for r in ok),
        "gpu_hour_usd": gpu_hour_usd,
        "cost_per_million_output_tokens_usd": _cost(gpu_hour_usd, num_gpus, out_tps),
        "cost_per_million_total_tokens_usd": _cost(gpu_hour_usd, num_gpus, (in_tok + out_tok) / dur),
    }
    res.update(usage_summary(ok))
    if goodput_slo_ms:
        good = sum(1 for r, t in zip(ok, tpots) if _meets(r, t, goodput_slo_ms))
        res["goodput_slo_ms"] = dict(goodput_slo_ms)
        res["request_goodput"] = good / dur
    return res


def usage_summary(ok: Sequence[RequestRecord]) -> dict:
    """Server-usage figures of successful requests (see the module docstring); None when absent."""
    cached = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    hits, prompts = sum(r.cached_tokens for r in cached), sum(r.prompt_tokens for r in cached)
    by_turn: dict[int, list[int]] = {}
    for r in cached:
        acc = by_turn.setdefault(r.spec.turn, [0, 0])
        acc[0] += r.cached_tokens
        acc[1] += r.prompt_tokens
    reasoning = [r.reasoning_tokens for r in ok if r.reasoning_tokens is not None]
    out_tok = sum(r.output_tokens for r in ok)
    return {
        "server_token_counts": bool(ok) and all(r.prompt_tokens is not None and r.completion_tokens is not None
                                                for r in ok),
        "total_cached_tokens": hits if cached else None,
        "usage_prefix_hit_rate": hits / prompts if prompts else None,
        "usage_prefix_hit_rate_by_turn": {str(t): h / n for t, (h, n) in sorted(by_turn.items())} if cached else None,
        "usage_prefix_hit_rate_later_turns": _later_turns_rate(cached),
        "total_reasoning_tokens": sum(reasoning) if reasoning else None,
        "reasoning_token_share": (sum(reasoning) / out_tok) if reasoning and out_tok else None,
    }


def _later_turns_rate(cached: Sequence[RequestRecord]) -> float | None:
    later = [r for r in cached if r.spec.turn > 0]
    n = sum(r.prompt_tokens for r in later)
    return sum(r.cached_tokens for r in later) / n if n else None


def _cost(usd_per_gpu_hour: float, num_gpus: float, tok_per_s: float) -> float | None:
    if tok_per_s <= 0:
        return None
    return usd_per_gpu_hour * num_gpus / (tok_per_s * 3600.0) * 1e6


def _meets(rec: RequestRecord, tpot: float | None, slo_ms: dict[str, float]) -> bool:
    vals = {"ttft": rec.ttft_s, "tpot": tpot, "e2el": rec.e2el_s}
    for name, limit in slo_ms.items():
        v = vals.get(name)
        if v is not None and v * 1000.0 > limit:
            return False
    return True


def finite_or_none(x: float | None) -> float | None:
    """JSON-safe number."""
    return None if x is None or not math.isfinite(x) else x
