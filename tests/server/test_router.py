"""The DP router balances token load, keeps session affinity and survives a dead rank."""

from __future__ import annotations

import random

import pytest

from server.router import DPRouter


def _simulate(route, finish, requests, num_ranks=2, rate=256):
    """Toy cluster: each tick one request arrives and every rank works off `rate` tokens of its
    oldest requests. Returns the mean over ticks of max/mean outstanding tokens per rank."""
    queues = [[] for _ in range(num_ranks)]  # per rank: [request id, tokens left]
    ratios = []
    for rid, (prompt, out) in enumerate(requests):
        queues[route(rid, prompt, out)].append([rid, prompt + out])
        for q in queues:
            budget = rate
            while q and budget:
                step = min(budget, q[0][1])
                q[0][1] -= step
                budget -= step
                if q[0][1] == 0:
                    finish(q.pop(0)[0])
        owed = [sum(w for _, w in q) for q in queues]
        mean = sum(owed) / num_ranks
        if mean:
            ratios.append(max(owed) / mean)
    return sum(ratios) / len(ratios)


def test_token_load_beats_round_robin_on_mixed_lengths():
    rng = random.Random(0)
    requests = [(rng.choice([50, 2000]), rng.choice([16, 300])) for _ in range(500)]
    router = DPRouter(2)
    balanced = _simulate(lambda rid, p, o: router.assign(rid, p, o), router.on_finish, requests)
    round_robin = _simulate(lambda rid, p, o: rid % 2, lambda rid: None, requests)
    assert balanced < round_robin


def test_least_loaded_rank_wins_and_finish_releases():
    router = DPRouter(3, block_size=16)
    a = router.assign(1, prompt_tokens=1000, max_tokens=10)
    b = router.assign(2, prompt_tokens=10, max_tokens=10)
    c = router.assign(3, prompt_tokens=10, max_tokens=10)
    assert len({a, b, c}) == 3
    assert router.assign(4, 10, 10) in (b, c)  # not the rank holding the long prompt
    router.on_heartbeat(b, kv_blocks_used=100)
    router.on_tokens(2, 5)
    assert router.ranks[b].owed[2].prefill == 0 and router.ranks[b].kv_tokens == 1600
    router.on_finish(1, completion_tokens=10)
    assert router.ranks[a].load == 0
    assert router.imbalance() >= 1.0


def test_session_affinity_and_dead_rank():
    router = DPRouter(2)
    first = router.assign(1, 10, 10, session="user-7")
    router.assign(2, 5000, 10)  # load the other rank... affinity must still win
    assert router.assign(3, 10, 10, session="user-7") == first
    lost = router.mark_dead(first)
    assert {1, 3} <= set(lost)
    assert router.assign(4, 10, 10, session="user-7") != first
    router.mark_dead(1 - first)
    with pytest.raises(RuntimeError, match="no worker"):
        router.pick()
