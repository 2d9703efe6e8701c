"""Issue 38, finding 6, on a real `ringserve serve`: large /tokenize and chat requests tokenize off
the event loop. While a flood of them is in flight `/health` keeps answering — each probe in a
small fraction of the time one of those requests takes (on the loop, a probe waited for a whole
encode) — every prompt's ids are what the tokenizer gives, and the front's memory comes back.
The absolute figures (64 maximal requests) are perf/bench_front_flood.py's."""
from __future__ import annotations

import json
import random
import string
import threading
import time
import urllib.error
import urllib.request

import pytest

from server.tokenizer import Tokenizer
from server_process import API_KEY, Server

BODY_CHARS = 192 << 10  # large enough to take the tiny tokenizer a second or more, small enough for the suite


@pytest.fixture(scope="module")
def front(model_dir):
    s = Server(model_dir, "--max-num-seqs", "4")
    yield s
    assert s.stop() == 0, s.output()


def _text(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 9)))
                    for _ in range(BODY_CHARS // 5))[:BODY_CHARS]


def _post(url: str, body: dict) -> tuple[int, dict, float]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read()), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), time.monotonic() - t0


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_health_answers_while_a_flood_of_large_inputs_tokenizes(front, model_dir):
    tok = Tokenizer.from_dir(model_dir)
    texts = [_text(i) for i in range(6)]
    jobs = [("/tokenize", {"prompt": t}) for t in texts[:3]] + \
           [("/tokenize", {"messages": [{"role": "user", "content": texts[3]}]})] + \
           [("/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": t}]})
            for t in texts[4:]]
    rss0 = _rss_mib(front.proc.pid)
    results: list = [None] * len(jobs)

    def run(i: int) -> None:
        results[i] = _post(front.url + jobs[i][0], jobs[i][1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    probes = []
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        with urllib.request.urlopen(front.url + "/health", timeout=600) as r:
            assert r.status == 200
        probes.append(time.monotonic() - t0)
        time.sleep(0.05)
    for t in threads:
        t.join()
    quickest = min(took for _, _, took in results)
    assert len(probes) >= 5 and max(probes) < quickest / 4, (max(probes), quickest, len(probes))
    for i, (status, body, _) in enumerate(results[:3]):
        assert status == 200 and body["tokens"] == tok.encode(texts[i]), status
    chat = results[3][1]  # rendered in the model's chat format around the message, which it holds whole
    assert results[3][0] == 200 and chat["count"] == len(chat["tokens"]) and texts[3] in tok.decode(chat["tokens"])
    for status, body, _ in results[4:]:  # rendered and encoded, then found longer than the context
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    time.sleep(1.0)
    assert _rss_mib(front.proc.pid) - rss0 < 64, (rss0, _rss_mib(front.proc.pid))
