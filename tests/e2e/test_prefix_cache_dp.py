"""Prefix caching across data-parallel ranks (`ringserve serve --dp 2`, tiny V4 model): a session
resent with the same `user` goes back to the rank that served it (server/router.py), hits its
cached prefix there and answers as its cold run did; the same prompt sent under a session that
lives on the other rank finds nothing cached. The hits are read from /metrics (vLLM's
prefix_cache_queries / prefix_cache_hits counters, summed from the ranks' heartbeats)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from server_process import API_KEY, Server

HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
QUERIES, HITS = "ringserve:prefix_cache_queries_total", "ringserve:prefix_cache_hits_total"


def _complete(server, prompt: str, user: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "user": user}
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(), HEADERS)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _counters(server) -> tuple[float, float]:
    """(queries, hits) from one /metrics scrape (one heartbeat sum)."""
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req) as r:
        lines = r.read().decode().splitlines()
    total = lambda name: sum(float(x.split()[-1]) for x in lines if x.startswith(name))  # noqa: E731
    return total(QUERIES), total(HITS)


def _after(server, queries_before: float, prompt_tokens: int) -> tuple[float, float]:
    """The counters once the heartbeats include the request just answered (queries risen by its
    prompt); they refresh about once a second."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        queries, hits = _counters(server)
        if queries >= queries_before + prompt_tokens:
            return queries, hits
        time.sleep(0.2)
    raise AssertionError("the prefix-cache query counter never counted the request")


def test_a_session_resent_hits_its_prefix_on_the_rank_that_holds_it(model_dir):
    server = Server(model_dir, "--dp", "2", "--max-num-seqs", "4")
    try:
        prompts = {"alice": "alice keeps a long conversation going with the model here " * 5,
                   "bob": "bob asks about something else entirely, again and again " * 5}
        cold: dict[str, dict] = {}

        def first(user: str, max_tokens: int) -> None:
            cold[user] = _complete(server, prompts[user], user, max_tokens)

        # Both at once: whichever is routed first is still in flight when the other is routed
        # (the front's event loop routes one at a time), so the second goes to the other rank
        # (least owed tokens); each rank now caches one session's prompt.
        threads = [threading.Thread(target=first, args=(user, 24)) for user in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert set(cold) == {"alice", "bob"}
        queries, hits = _after(server, 0, sum(c["usage"]["prompt_tokens"] for c in cold.values()))
        assert hits == 0  # nothing was cached before

        for user in prompts:
            again = _complete(server, prompts[user], user, 24)
            n = again["usage"]["prompt_tokens"]
            queries, new_hits = _after(server, queries, n)
            assert new_hits - hits >= 16, f"{user}'s resend found no cached block on its rank"
            assert new_hits - hits < n  # the last prompt token is always computed
            assert again["choices"][0]["text"] == cold[user]["choices"][0]["text"]
            hits = new_hits

        # Alice's prompt under bob's session: bob's rank never saw it, nothing is cached there.
        stray = _complete(server, prompts["alice"], "bob", 24)
        queries, new_hits = _after(server, queries, stray["usage"]["prompt_tokens"])
        assert new_hits == hits, "alice's prefix was found on bob's rank: the sessions share a rank"
        assert stray["choices"][0]["text"] == cold["alice"]["choices"][0]["text"]
    finally:
        code = server.stop()
    assert code == 0, server.output()
