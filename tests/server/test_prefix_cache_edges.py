"""Prefix caching at the server's edges: flags, the cache_salt field, the counters, routing."""

from __future__ import annotations

import pytest

from server.cli import build_parser, engine_config_from
from server.metrics import Metrics
from server.protocol import Limits, ProtocolError, parse_completion
from server.router import DPRouter


@pytest.mark.parametrize("flags, on, replay", [([], True, "exact"), (["--no-enable-prefix-caching"], False, "exact"),
                                               (["--enable-prefix-caching", "--prefix-replay", "bounded"], True,
                                                "bounded")])
def test_flags_reach_the_engine_config(flags, on, replay):
    args = build_parser().parse_args(["generate", "--prompt-ids", "1,2", *flags])
    cfg = engine_config_from(args)
    assert (cfg.enable_prefix_caching, cfg.prefix_replay) == (on, replay)


def test_cache_salt_is_read_and_bounded():
    served = ["m"]
    assert parse_completion({"prompt": [1, 2]}, Limits(), served).params.cache_salt is None
    req = parse_completion({"prompt": [1, 2], "cache_salt": "tenant"}, Limits(), served)
    assert req.params.cache_salt == "tenant"
    with pytest.raises(ProtocolError):
        parse_completion({"prompt": [1, 2], "cache_salt": 5}, Limits(), served)
    with pytest.raises(ProtocolError):
        parse_completion({"prompt": [1, 2], "cache_salt": "x" * 1000}, Limits(), served)


def test_prefix_counters_follow_cumulative_totals():
    m = Metrics("m")
    seen = []
    for q, h in [(0, 0), (100, 40), (100, 40), (250, 90), (30, 10)]:  # the last: a worker restarted
        m.set_prefix_cache_stats(q, h)
        seen.append((m.registry.get_sample_value("ringserve:prefix_cache_queries_total", {"model_name": "m"}),
                     m.registry.get_sample_value("ringserve:prefix_cache_hits_total", {"model_name": "m"})))
    assert seen == [(0, 0), (100, 40), (100, 40), (250, 90), (280, 100)]


def test_a_returning_session_owes_only_its_uncached_prefill():
    r = DPRouter(2, block_size=16)
    r.assign(1, 100, 8, session="s")
    rank = r._where[1]
    assert r.ranks[rank].queued_prefill == 100  # nothing cached yet
    r.on_finish(1, 8)
    r.assign(2, 130, 8, session="s")
    assert r._where[2] == rank
    assert r.ranks[rank].queued_prefill == 130 - 96  # the previous prompt's 6 full blocks are cached
    r.assign(3, 130, 8, session="other")  # a new session goes to the other, empty rank and owes it all
    assert r._where[3] != rank and r.ranks[r._where[3]].queued_prefill == 130
