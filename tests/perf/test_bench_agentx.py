"""The AgentX-like generator: determinism, shape statistics, growth, hashes; the trace format."""

from __future__ import annotations

import math

import numpy as np
import pytest

from perf.serving import agentx, metrics, runner, trace

BIG = dict(max_context=10**9, first_turn_tokens=(200, 400), append_tokens=(20, 100))


def dump(trees):
    return [r.to_json() for t in trees for r in t.all_requests()]


def test_deterministic_for_a_seed():
    p = agentx.AgentXParams(num_sessions=6, seed=3)
    assert dump(agentx.generate(p)) == dump(agentx.generate(p))
    assert dump(agentx.generate(p)) != dump(agentx.generate(agentx.AgentXParams(num_sessions=6, seed=4)))
    # tree i does not depend on how many trees there are
    assert dump(agentx.generate(p)[:2]) == dump(agentx.generate(agentx.AgentXParams(num_sessions=2, seed=3)))


def test_shape_statistics_match_parameters():
    p = agentx.AgentXParams(num_sessions=400, turns=(5, 20), long_share=0.3, fork_prob=0.1, **BIG)
    trees = agentx.generate(p)
    turns = [len(t.requests) for t in trees]
    assert min(turns) >= 5 and max(turns) <= 20
    # log-uniform turn count: mean (hi − lo) / ln(hi / lo) ≈ 10.8
    assert np.mean(turns) == pytest.approx((20 - 5) / math.log(4), rel=0.1)
    outs = [r.output_length for t in trees for r in t.all_requests()]
    long = np.mean([o >= p.long_output[0] for o in outs])
    assert long == pytest.approx(0.3, abs=0.03)
    assert all(p.short_output[0] <= o <= p.long_output[1] for o in outs)
    forkable = sum(len(t.requests) - 1 for t in trees)
    forks = sum(len(t.children) for t in trees)
    assert forks / forkable == pytest.approx(0.1, abs=0.02)
    subs = [len(c) for t in trees for c in t.children.values()]
    assert set(subs) <= {1, 2, 3, 4} and np.mean(subs) == pytest.approx(2.5, abs=0.3)


def test_context_grows_by_output_and_tool_tokens_and_shares_its_prefix():
    p = agentx.AgentXParams(num_sessions=5, turns=(6, 6), **BIG)
    for tree in agentx.generate(p):
        reqs = tree.requests
        for prev, cur in zip(reqs, reqs[1:]):
            tool = cur.input_length - prev.input_length - prev.output_length
            assert p.append_tokens[0] <= tool <= p.append_tokens[1]
            full = prev.input_length // p.block_size
            assert cur.hash_ids[:full] == prev.hash_ids[:full]
            assert len(cur.hash_ids) == math.ceil(cur.input_length / p.block_size)
        # ideal hits: each later turn reuses exactly the full blocks of the turn before
        hits, total = metrics.ideal_prefix_hit_tokens([(r.hash_ids, r.input_length) for r in reqs], p.block_size)
        assert hits == sum((r.input_length // p.block_size) * p.block_size for r in reqs[:-1])
        assert total == sum(r.input_length for r in reqs)


def test_context_cap_compacts_to_the_first_turn_prefix():
    p = agentx.AgentXParams(num_sessions=20, turns=(30, 30), max_context=1500)
    for tree in agentx.generate(p):
        first = tree.requests[0]
        for r in tree.requests:
            assert r.input_length + r.output_length <= p.max_context
        full = first.input_length // p.block_size
        assert all(r.hash_ids[:full] == first.hash_ids[:full] for r in tree.requests)


def test_think_times_and_subagent_links():
    p = agentx.AgentXParams(num_sessions=50, fork_prob=0.5, think_s=(0.5, 30.0), **BIG)
    trees = agentx.generate(p)
    for t in trees:
        assert t.requests[0].delay_ms == 0.0
        assert all(500.0 <= r.delay_ms <= 30000.0 for r in t.requests[1:])
        for turn, children in t.children.items():
            assert all(c.requests[0].parent == (t.session_id, turn) for c in children)
    delays = [r.delay_ms for t in trees for r in t.requests[1:]]
    assert np.median(delays) == pytest.approx(math.sqrt(0.5 * 30) * 1000, rel=0.2)


def test_trace_round_trip(tmp_path):
    trees = agentx.generate(agentx.AgentXParams(num_sessions=5, fork_prob=0.5))
    path = tmp_path / "t.jsonl"
    trace.write_trace(path, trees)
    back = trace.read_trace(path)
    assert dump(back) == dump(trees)
    assert runner.count_requests(back) == sum(1 for _ in path.read_text().splitlines())


def test_trace_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"session_id": "a", "input_length": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        trace.read_trace(path)


def test_gamma_arrivals():
    assert runner.arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    t = runner.arrival_offsets(4001, 50.0, 0.5, 0)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert t[-1] / 4000 == pytest.approx(1 / 50.0, rel=0.1)
    assert t == runner.arrival_offsets(4001, 50.0, 0.5, 0)
