"""Metric arithmetic of `ringserve bench` against hand-computed examples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from perf.serving import metrics
from perf.serving.prom_metrics import server_metrics
from perf.serving.records import RequestRecord, RequestSpec
from perf.serving.server_api import parse_prometheus


def rec(send: float, times: list[float], tokens: list[int], end: float, n: int | None, *, ready: float | None = None,
        exact: bool = True, prompt: int = 10) -> RequestRecord:
    return RequestRecord(RequestSpec("p", 8, prompt), ready_s=send if ready is None else ready, send_s=send,
                         first_token_s=times[0] if times else None, end_s=end, chunk_times=times,
                         chunk_tokens=tokens, chunk_tokens_exact=exact, prompt_tokens=prompt, completion_tokens=n, ok=True)


def test_ttft_tpot_itl_with_a_multi_token_chunk():
    # first token at 0.1 s; one token at 0.15; three tokens together at 0.45; stream ends 0.46
    r = rec(0.0, [0.1, 0.15, 0.45], [1, 1, 3], 0.46, 5)
    assert r.ttft_s == pytest.approx(0.1)
    assert metrics.tpot_s(r) == pytest.approx((0.46 - 0.1) / 4)  # 90 ms, first token excluded
    itl = metrics.record_itl_s(r)
    assert itl == pytest.approx([0.05, 0.1, 0.1, 0.1])  # the 300 ms gap split over 3 tokens
    assert sum(itl) == pytest.approx(0.45 - 0.1)


def test_first_chunk_extra_tokens_have_no_itl_and_single_token_has_no_tpot():
    r = rec(0.0, [0.2, 0.3], [2, 1], 0.3, 3)
    assert metrics.record_itl_s(r) == pytest.approx([0.1])
    assert metrics.tpot_s(rec(0.0, [0.2], [1], 0.2, 1)) is None


def test_apportion_spreads_unknown_surplus_over_later_chunks():
    assert metrics.apportion([1, 1, 1], 7, exact=False) == [1, 3, 3]
    assert metrics.apportion([1, 1, 1], 8, exact=False) == [1, 4, 3]
    assert metrics.apportion([1, 1, 1], 8, exact=True) == [1, 1, 1]
    assert metrics.apportion([1], 4, exact=False) == [4]
    # chunk-count ITL under inexact counts: gaps split by apportioned counts
    r = rec(0.0, [0.1, 0.3, 0.5], [1, 1, 1], 0.5, 5, exact=False)
    assert metrics.record_itl_s(r) == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_summary_matches_numpy_linear_percentiles():
    vals = [5.0, 1.0, 9.0, 3.0, 7.0]
    s = metrics.summary(vals, [50, 90, 99])
    assert s["mean"] == pytest.approx(5.0)
    assert s["p50"] == pytest.approx(5.0)
    assert s["p90"] == pytest.approx(np.percentile(vals, 90)) == pytest.approx(8.2)
    assert metrics.summary([], [50])["p50"] is None


def test_run_level_numbers():
    # two requests over a 2 s run; 1 GPU at 36 USD/h
    a = rec(0.0, [0.5, 1.0], [1, 1], 1.0, 2, ready=0.0, prompt=100)
    b = rec(1.0, [1.5, 1.75, 2.0], [1, 1, 1], 2.0, 3, ready=0.25, prompt=200)
    m = metrics.compute([a, b], duration_s=2.0, start_s=0.0, num_gpus=1, gpu_hour_usd=36.0)
    assert m["total_output_tokens"] == 5 and m["total_input_tokens"] == 300
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(152.5)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["peak_concurrent_requests"] == 1  # b starts exactly when a ends
    assert m["peak_output_throughput"] == pytest.approx(3.0)  # bin [1, 2): 1.0, 1.5, 1.75
    assert m["ttft_ms"]["mean"] == pytest.approx(500.0)
    assert m["queue_ms"]["mean"] == pytest.approx(375.0)  # b waited 0.75 s for a slot
    assert m["ttft_from_ready_ms"]["mean"] == pytest.approx(875.0)
    assert m["tpot_ms"]["p50"] == pytest.approx(375.0)  # a: 500, b: 250
    assert m["interactivity_tok_s_per_user"]["p50"] == pytest.approx(1000 / 375.0)
    assert m["interactivity_tok_s_per_user"]["p90"] == pytest.approx(1000 / 475.0)  # slow tail
    assert m["cost_per_million_output_tokens_usd"] == pytest.approx(36.0 / (2.5 * 3600) * 1e6)


def test_per_gpu_and_goodput():
    a = rec(0.0, [0.1, 0.2], [1, 1], 0.2, 2)
    b = rec(0.0, [0.9, 1.0], [1, 1], 1.0, 2)
    m = metrics.compute([a, b], 1.0, 0.0, num_gpus=4, goodput_slo_ms={"ttft": 500})
    assert m["output_throughput_per_gpu"] == pytest.approx(1.0)
    assert m["request_goodput"] == pytest.approx(1.0)
    assert m["failed"] == 0


def test_ideal_prefix_hits_on_a_constructed_trace():
    reqs = [([1, 2, 3], 10),     # blocks 1, 2 full, 3 partial: nothing seen yet
            ([1, 2, 4, 5], 16),  # 1, 2 seen → 8 tokens; 4 unseen stops the run
            ([1, 9, 4], 12),     # 1 seen, 9 unseen → 4 (4 was seen but follows a miss)
            ([1, 2, 3], 10)]     # 1, 2 seen; 3 is a partial block → 8
    hits, total = metrics.ideal_prefix_hit_tokens(reqs, block_size=4)
    assert (hits, total) == (20, 48)


PROM_BEFORE = """# HELP x
ringserve:spec_decode_num_drafts_total{model_name="m"} 10
ringserve:spec_decode_num_draft_tokens_total{model_name="m"} 30
ringserve:spec_decode_num_accepted_tokens_total{model_name="m"} 20
ringserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9
ringserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 7
ringserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 4
ringserve:num_preemptions_total{model_name="m"} 1
"""
PROM_AFTER = """ringserve:spec_decode_num_drafts_total{model_name="m"} 110
ringserve:spec_decode_num_draft_tokens_total{model_name="m"} 330
ringserve:spec_decode_num_accepted_tokens_total{model_name="m"} 220
ringserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 99
ringserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 67
ringserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 54
ringserve:num_preemptions_total{model_name="m"} 4
ringserve:dp_imbalance{model_name="m"} 1.25
"""


def test_server_metrics_from_scrapes():
    s = server_metrics(parse_prometheus(PROM_BEFORE), parse_prometheus(PROM_AFTER), dp_samples=[1.0, 1.5])
    assert s["spec_acceptance_length"] == pytest.approx(1 + 200 / 100)
    assert s["spec_acceptance_rate"] == pytest.approx(200 / 300)
    assert s["spec_per_position_acceptance"] == pytest.approx([0.9, 0.6, 0.5])
    assert s["num_preemptions"] == 3
    assert s["achieved_prefix_hit_rate"] is None  # counters absent → n/a
    assert (s["dp_imbalance_mean"], s["dp_imbalance_max"]) == (1.25, 1.5)


def test_server_metrics_without_an_endpoint():
    s = server_metrics(None, None)
    assert s["metrics_endpoint"] is False
    assert all(v is None for k, v in s.items() if k != "metrics_endpoint")


def test_vllm_names_and_prefix_cache():
    before = parse_prometheus('vllm:prefix_cache_queries_total{engine="0"} 100\nvllm:prefix_cache_hits_total 10\n')
    after = parse_prometheus('vllm:prefix_cache_queries_total{engine="0"} 300\nvllm:prefix_cache_queries_total{engine="1"} 100\n'
                             'vllm:prefix_cache_hits_total 160\n')
    assert server_metrics(before, after)["achieved_prefix_hit_rate"] == pytest.approx(150 / 300)
    assert math.isnan(parse_prometheus("x NaN\n")[0][2])
