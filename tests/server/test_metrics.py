"""server.metrics: benchmark-exact request timings, monotone engine counters, valid exposition."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import Metrics

MODEL = "dsv4-flash"
L = {"model_name": MODEL}

EXPECTED_NAMES = [
    "ringserve:num_requests_running",
    "ringserve:num_requests_waiting",
    "ringserve:kv_cache_usage_perc",
    "ringserve:dp_imbalance",
    "ringserve:loop_pause_max_seconds",
    "ringserve:cpu_compute_threads",
    "ringserve:prompt_tokens_total",
    "ringserve:generation_tokens_total",
    "ringserve:request_success_total",
    "ringserve:num_preemptions_total",
    "ringserve:num_aborted_requests_total",
    "ringserve:http_requests_client_disconnected_total",
    "ringserve:requests_rejected_total",
    "ringserve:spec_decode_num_drafts_total",
    "ringserve:spec_decode_num_draft_tokens_total",
    "ringserve:spec_decode_num_accepted_tokens_total",
    "ringserve:spec_decode_num_accepted_tokens_per_pos_total",
    "ringserve:time_to_first_token_seconds",
    "ringserve:time_per_output_token_seconds",
    "ringserve:inter_token_latency_seconds",
    "ringserve:e2e_request_latency_seconds",
    "ringserve:request_queue_time_seconds",
]


def val(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {**L, **labels})


def hist(m: Metrics, name: str) -> tuple[float, float]:
    return val(m, f"ringserve:{name}_count"), val(m, f"ringserve:{name}_sum")


def test_stream_timings_match_benchmark_formulas():
    m = Metrics(MODEL)
    # Times are binary fractions so every difference is exact.
    t = m.request_timer(arrival=0.0)
    t.scheduled(0.125)
    t.tokens(0, 0.2)            # role-only chunk: ignored
    t.first_token(0.25)         # TTFT = 0.25
    t.tokens(1, 0.3125)         # gap 0.0625 over 1 token
    t.tokens(3, 0.6875)         # gap 0.375 over 3 tokens -> 0.125 x3
    t.tokens(2, 0.8125)         # gap 0.125 over 2 tokens -> 0.0625 x2
    t.finish("stop", prompt_tokens=11, completion_tokens=7, now=1.0)

    assert hist(m, "time_to_first_token_seconds") == (1.0, 0.25)
    assert hist(m, "e2e_request_latency_seconds") == (1.0, 1.0)
    assert hist(m, "request_queue_time_seconds") == (1.0, 0.125)
    # TPOT = (e2e - ttft) / (N - 1) = 0.75 / 6
    assert hist(m, "time_per_output_token_seconds") == (1.0, 0.125)
    # ITL: one observation per token after the first chunk: 0.0625, 0.125 x3, 0.0625 x2.
    count, total = hist(m, "inter_token_latency_seconds")
    assert count == 6 and total == pytest.approx(0.5625, abs=1e-12)
    assert val(m, "ringserve:inter_token_latency_seconds_bucket", le="0.05") == 0
    assert val(m, "ringserve:inter_token_latency_seconds_bucket", le="0.075") == 3
    assert val(m, "ringserve:inter_token_latency_seconds_bucket", le="0.15") == 6
    assert val(m, "ringserve:time_to_first_token_seconds_bucket", le="0.2") == 0
    assert val(m, "ringserve:time_to_first_token_seconds_bucket", le="0.3") == 1

    assert val(m, "ringserve:prompt_tokens_total") == 11
    assert val(m, "ringserve:generation_tokens_total") == 7
    assert val(m, "ringserve:request_success_total", finished_reason="stop") == 1
    assert val(m, "ringserve:request_success_total", finished_reason="length") == 0
    assert t.num_tokens == 7


def test_second_request_accumulates_and_single_token_has_no_tpot():
    m = Metrics(MODEL)
    t = m.request_timer(arrival=10.0)
    t.tokens(1, 10.5)
    t.finish("length", prompt_tokens=3, completion_tokens=1, now=10.75)
    assert hist(m, "time_to_first_token_seconds") == (1.0, 0.5)
    assert hist(m, "time_per_output_token_seconds") == (0.0, 0.0)
    assert hist(m, "inter_token_latency_seconds") == (0.0, 0.0)
    assert hist(m, "request_queue_time_seconds") == (0.0, 0.0)  # never scheduled() -> not observed
    assert val(m, "ringserve:request_success_total", finished_reason="length") == 1

    # Non-streamed: one chunk with every token, TTFT == time of that chunk.
    t2 = m.request_timer(arrival=20.0)
    t2.tokens(4, 21.0)
    t2.finish("stop", prompt_tokens=5, completion_tokens=4, now=21.0)
    assert hist(m, "time_to_first_token_seconds") == (2.0, 1.5)
    assert hist(m, "time_per_output_token_seconds") == (1.0, 0.0)
    assert val(m, "ringserve:prompt_tokens_total") == 8
    assert val(m, "ringserve:generation_tokens_total") == 5


def test_abort_error_and_double_finish():
    m = Metrics(MODEL)
    t = m.request_timer(arrival=0.0)
    t.tokens(1, 0.5)
    t.tokens(2, 1.0)
    t.abort(prompt_tokens=4, completion_tokens=3, client_disconnected=True)
    t.finish("stop", 4, 3, now=2.0)           # ignored: already finished
    t.tokens(1, 3.0)                          # ignored
    assert val(m, "ringserve:num_aborted_requests_total") == 1
    assert val(m, "ringserve:http_requests_client_disconnected_total") == 1
    assert val(m, "ringserve:prompt_tokens_total") == 4
    assert val(m, "ringserve:generation_tokens_total") == 3
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "time_per_output_token_seconds"):
        assert hist(m, name) == (0.0, 0.0), name
    assert val(m, "ringserve:request_success_total", finished_reason="stop") == 0

    t2 = m.request_timer(arrival=0.0)
    t2.finish("abort", 1, 0, now=1.0)         # same as abort()
    t3 = m.request_timer(arrival=0.0)
    t3.tokens(1, 0.1)
    t3.finish("error", 2, 1, now=1.0)
    assert val(m, "ringserve:num_aborted_requests_total") == 2
    assert val(m, "ringserve:num_errored_requests_total") == 1
    assert val(m, "ringserve:http_requests_client_disconnected_total") == 1
    assert hist(m, "e2e_request_latency_seconds") == (0.0, 0.0)
    assert val(m, "ringserve:prompt_tokens_total") == 7

    m.client_disconnected()
    assert val(m, "ringserve:http_requests_client_disconnected_total") == 2


def test_rejections_and_label_cardinality():
    m = Metrics(MODEL)
    assert val(m, "ringserve:requests_rejected_total", reason="overload") == 0
    m.request_rejected("overload")
    m.request_rejected("overload")
    m.request_rejected("invalid")
    m.request_rejected("Bad reason with spaces {}")
    m.request_success("weird/reason")
    assert val(m, "ringserve:requests_rejected_total", reason="overload") == 2
    assert val(m, "ringserve:requests_rejected_total", reason="invalid") == 1
    assert val(m, "ringserve:requests_rejected_total", reason="other") == 1
    assert val(m, "ringserve:request_success_total", finished_reason="other") == 1


def test_engine_stats_counters_are_monotone():
    m = Metrics(MODEL)
    names = ["ringserve:num_preemptions_total", "ringserve:spec_decode_num_drafts_total",
             "ringserve:spec_decode_num_draft_tokens_total", "ringserve:spec_decode_num_accepted_tokens_total"]
    snaps = [
        # preempt, drafts, draft_tokens, accepted per position
        (0, 0, 0, []),
        (2, 10, 50, [9, 7, 4]),
        (2, 10, 50, [9, 7, 4]),              # unchanged: no increment
        (5, 14, 70, [13, 10, 6, 1]),         # a new position appears
        (1, 3, 15, [3, 2]),                  # workers restarted from zero; position 2/3 unchanged
        (4, 5, 25, [5, 4]),
    ]
    history: dict[str, list[float]] = {n: [] for n in names}
    for i, (pre, drafts, dtoks, acc) in enumerate(snaps):
        m.set_engine_stats(running=i, waiting=2 * i, kv_usage=0.1 * i, dp_imbalance=1.0 + i / 100,
                           loop_pause_s=0.001 * i, preemptions_total=pre, spec_drafts_total=drafts,
                           spec_draft_tokens_total=dtoks, spec_accepted_per_position=acc, compute_threads=i)
        for n in names:
            history[n].append(val(m, n))
    for n, h in history.items():
        assert all(b >= a for a, b in zip(h, h[1:])), (n, h)
    # 5 before the restart, then +1 (reset: new value counts) and +3.
    assert val(m, "ringserve:num_preemptions_total") == 5 + 1 + 3
    assert val(m, "ringserve:spec_decode_num_drafts_total") == 14 + 3 + 2
    assert val(m, "ringserve:spec_decode_num_draft_tokens_total") == 70 + 15 + 10
    assert val(m, "ringserve:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 13 + 3 + 2
    assert val(m, "ringserve:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 10 + 2 + 2
    assert val(m, "ringserve:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 6
    assert val(m, "ringserve:spec_decode_num_accepted_tokens_per_pos_total", position="3") == 1
    assert val(m, "ringserve:spec_decode_num_accepted_tokens_total") == 18 + 14 + 6 + 1
    # Gauges hold the last snapshot.
    assert val(m, "ringserve:num_requests_running") == 5
    assert val(m, "ringserve:num_requests_waiting") == 10
    assert val(m, "ringserve:kv_cache_usage_perc") == pytest.approx(0.5)
    assert val(m, "ringserve:dp_imbalance") == pytest.approx(1.05)
    assert val(m, "ringserve:loop_pause_max_seconds") == pytest.approx(0.005)
    assert val(m, "ringserve:cpu_compute_threads") == 5


def _populated() -> Metrics:
    m = Metrics(MODEL)
    t = m.request_timer(arrival=0.0)
    t.scheduled(0.01)
    t.tokens(1, 0.1)
    t.tokens(2, 0.2)
    t.finish("stop", 5, 3, now=0.3)
    m.request_rejected("overload")
    m.client_disconnected()
    m.set_engine_stats(1, 0, 0.25, 1.0, 0.0, 1, 2, 6, [2, 1])
    return m


def test_exposition_parses_and_has_every_metric():
    m = _populated()
    body, content_type = m.render()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    text = body.decode()
    families = list(text_string_to_metric_families(text))
    sample_names = {s.name for f in families for s in f.samples}
    for name in EXPECTED_NAMES:
        assert f"# TYPE {name} " in text, name
    for name in EXPECTED_NAMES:
        if name.endswith("_seconds") and name != "ringserve:loop_pause_max_seconds":
            assert {f"{name}_bucket", f"{name}_count", f"{name}_sum"} <= sample_names, name
        else:
            assert name in sample_names, name
    # Every sample carries model_name.
    for f in families:
        for s in f.samples:
            assert s.labels.get("model_name") == MODEL, s


def test_isolated_registries():
    m = _populated()
    other = Metrics("other-model")
    other.request_rejected("overload")
    assert val(m, "ringserve:requests_rejected_total", reason="overload") == 1
    assert other.registry.get_sample_value("ringserve:requests_rejected_total",
                                           {"model_name": "other-model", "reason": "overload"}) == 1
    assert REGISTRY.get_sample_value("ringserve:requests_rejected_total",
                                     {"model_name": MODEL, "reason": "overload"}) is None
    assert b"other-model" not in m.render()[0]


def test_expert_parallel_stats():
    m = Metrics(MODEL)
    m.set_expert_parallel_stats([1.25, 2.0, 1.0], rebalances_total=3)
    assert val(m, "ringserve:expert_imbalance", layer="1") == 2.0
    assert val(m, "ringserve:expert_imbalance_max") == 2.0
    assert val(m, "ringserve:eplb_num_rebalances_total") == 3
    m.set_expert_parallel_stats([1.1, 1.2, 1.05], rebalances_total=5)  # after a rebalance, evener
    assert val(m, "ringserve:expert_imbalance", layer="1") == 1.2 and val(m, "ringserve:expert_imbalance_max") == 1.2
    assert val(m, "ringserve:eplb_num_rebalances_total") == 5
    names = {f.name for f in text_string_to_metric_families(m.render()[0].decode())}
    assert {"ringserve:expert_imbalance", "ringserve:eplb_num_rebalances"} <= names
