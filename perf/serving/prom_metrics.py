"""Server-side run metrics from two Prometheus scrapes (before and after the measured run).

Counters are summed over all label sets except `position`. Names are looked up under the
`ringserve:` prefix, then `vllm:` (same suffixes). Absent counters give None, never an error.

* acceptance rate = Δaccepted / Δdraft_tokens; acceptance length = 1 + Δaccepted / Δdrafts
  (tokens emitted per target forward); per-position acceptance[i] = Δaccepted_at_pos_i / Δdrafts.
* achieved prefix-hit rate = Δprefix_cache_hits / Δprefix_cache_queries (tokens).
* preemptions = Δnum_preemptions; DP imbalance = the gauge sampled during the run (mean, max).
"""

from __future__ import annotations

from collections.abc import Sequence

from perf.serving.server_api import Samples

PREFIXES = ("ringserve:", "vllm:")
DRAFTS = "spec_decode_num_drafts_total"
DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
ACCEPTED = "spec_decode_num_accepted_tokens_total"
ACCEPTED_POS = "spec_decode_num_accepted_tokens_per_pos_total"
PREEMPTIONS = "num_preemptions_total"
HITS = "prefix_cache_hits_total"
QUERIES = "prefix_cache_queries_total"
DP_IMBALANCE = "dp_imbalance"


def _total(samples: Samples | None, suffix: str) -> float | None:
    if not samples:
        return None
    for prefix in PREFIXES:
        vals = [v for n, _, v in samples if n == prefix + suffix]
        if vals:
            return float(sum(vals))
    return None


def _by_position(samples: Samples | None) -> dict[int, float]:
    out: dict[int, float] = {}
    if not samples:
        return out
    for prefix in PREFIXES:
        for n, labels, v in samples:
            if n == prefix + ACCEPTED_POS and "position" in labels:
                pos = int(labels["position"])
                out[pos] = out.get(pos, 0.0) + v
        if out:
            return out
    return out


def _delta(before: Samples | None, after: Samples | None, suffix: str) -> float | None:
    a = _total(after, suffix)
    if a is None:
        return None
    return a - (_total(before, suffix) or 0.0)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def gauge(samples: Samples | None, suffix: str = DP_IMBALANCE) -> float | None:
    """Current value of a gauge (max over label sets)."""
    if not samples:
        return None
    for prefix in PREFIXES:
        vals = [v for n, _, v in samples if n == prefix + suffix]
        if vals:
            return max(vals)
    return None


def server_metrics(before: Samples | None, after: Samples | None, dp_samples: Sequence[float] = ()) -> dict:
    """The server-side metric block of the result document."""
    drafts = _delta(before, after, DRAFTS)
    accepted = _delta(before, after, ACCEPTED)
    pos_after, pos_before = _by_position(after), _by_position(before)
    per_pos = [(pos_after[i] - pos_before.get(i, 0.0)) for i in sorted(pos_after)]
    return {
        "metrics_endpoint": after is not None,
        "spec_num_drafts": drafts,
        "spec_num_draft_tokens": _delta(before, after, DRAFT_TOKENS),
        "spec_num_accepted_tokens": accepted,
        "spec_acceptance_rate": _ratio(accepted, _delta(before, after, DRAFT_TOKENS)),
        "spec_acceptance_length": (1.0 + accepted / drafts) if accepted is not None and drafts else None,
        "spec_per_position_acceptance": [x / drafts for x in per_pos] if per_pos and drafts else None,
        "num_preemptions": _delta(before, after, PREEMPTIONS),
        "prefix_cache_hits": _delta(before, after, HITS),
        "prefix_cache_queries": _delta(before, after, QUERIES),
        "achieved_prefix_hit_rate": _ratio(_delta(before, after, HITS), _delta(before, after, QUERIES)),
        "dp_imbalance_mean": (sum(dp_samples) / len(dp_samples)) if dp_samples else gauge(after),
        "dp_imbalance_max": max(dp_samples) if dp_samples else gauge(after),
    }
