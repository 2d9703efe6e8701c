"""Prefill/decode faults with real processes, in the middle of a transfer or a stream: a prefill
that stalls or dies while a decode READs its blocks, a decode that dies while the proxy streams
its answer. (A decode that never comes, a corrupt block, a prefill dead between the legs:
tests/e2e/test_pd.py.)

For each, the client gets a clear answer within a bound, and afterwards the survivors are idle
(no request running or waiting, no lease, load, held block or pending READ, no KV block used),
a dead server left no process behind (its rings in /dev/shm are orphans the next `serve`
removes: a SIGKILLed owner cannot unlink them), and a fresh request through the proxy gives
the same greedy output as before the fault.

Cast (booted together): prefills P1 (stalled, then killed) and P2; decodes D1 (READ timeout
10 s, eager decode steps; killed last) and D2 (READ timeout 1.5 s). The proxy lists P1, P2 and D1, D2: with no load
it picks the first listed, so traffic goes P1 → D1 until a fault takes one of them out.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request

import pytest

pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed: PD disaggregation needs NIXL")

from process_state import all_gone, stop_process  # noqa: E402
from server_process import API_KEY, Server, segments_of, workers  # noqa: E402
from test_pd import (UCX_ENV, Proxy, _Deferred, _holds_nothing, _kill_leftovers, _kv, _leg1, _post,  # noqa: E402
                     _settles, _stop_cleanly)

COMMON = ("--max-num-seqs", "4", "--kv-connect-timeout", "2")
PROMPT = [(5 * i + 11) % 250 + 1 for i in range(40)]  # 3 blocks of 16, partial records of both ratios
GREEDY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cast(model_dir):
    """{"proxy", "only_d1", "p1", "p2", "d1", "d2", "want"}. want: the greedy text of GREEDY from
    D2 alone (a decode-role server serves plain requests too; test_pd shows the proxy's equals
    a colocated server's). only_d1: a second proxy with D1 as its only decode, to put a request
    on D1 beside a stream there (the first proxy would send it to the idle D2)."""
    os.environ.update(UCX_ENV)
    procs: list = []
    try:
        prefill = ("--kv-role", "prefill", "--kv-transfer", "nixl", "--kv-lease-timeout", "3",
                   "--kv-transfer-timeout", "10")
        p1, p2 = _Deferred(model_dir, *COMMON, *prefill), _Deferred(model_dir, *COMMON, *prefill)
        procs += [p1, p2]
        decode = ("--kv-role", "decode", "--kv-transfer", "nixl")
        # D1 decodes eagerly (~13 ms a token on the tiny model, the compiled step ~1.5 ms): the last
        # test's 900-token requests must still be decoding on D1 when the kill sequence reaches it
        d1 = _Deferred(model_dir, *COMMON, *decode, "--kv-transfer-timeout", "10", "--enforce-eager")
        d2 = _Deferred(model_dir, *COMMON, *decode, "--kv-transfer-timeout", "1.5")
        procs += [d1, d2]
        proxy = Proxy(model_dir.parent, [p1.url, p2.url], [d1.url, d2.url])
        procs.append(proxy)
        only_d1 = Proxy(model_dir.parent, [p2.url], [d1.url])
        procs.append(only_d1)
        for p in procs:
            p.wait_ready()
        status, body = _post(d2.url + "/v1/completions", GREEDY)
        assert status == 200, body
        yield {"proxy": proxy, "only_d1": only_d1, "p1": p1, "p2": p2, "d1": d1, "d2": d2,
               "want": body["choices"][0]["text"]}
        assert proxy.stop() == 0, proxy.output()
        assert only_d1.stop() == 0, only_d1.output()
        for s in (p1, p2, d1, d2):
            if s.proc.poll() is None:
                _stop_cleanly(s)
    finally:
        _kill_leftovers(procs)


def _idle(*servers: Server, timeout: float = 10.0) -> None:
    """No request running or waiting (/metrics), and no KV state held (_holds_nothing)."""
    for s in servers:
        _settles_metric(s, "running", 0, timeout)
        _settles_metric(s, "waiting", 0, timeout)
    _holds_nothing(*servers, timeout=timeout)


def _settles_metric(s: Server, which: str, want: float, timeout: float = 10.0) -> None:
    """Until /metrics shows `want` requests `which` ("running" or "waiting")."""
    deadline = time.monotonic() + timeout
    while True:
        got = _requests(s)[which]
        if got == want or time.monotonic() > deadline:
            assert got == want, (s.url, which, got)
            return
        time.sleep(0.05)


def _requests(s: Server) -> dict[str, float]:
    """{"running": n, "waiting": n} from the server's /metrics."""
    text = s.get("/metrics", API_KEY)[1]["text"]
    found = dict(re.findall(r'^ringserve:num_requests_(running|waiting)\{[^}]*\} (\S+)$', text, re.M))
    return {k: float(found[k]) for k in ("running", "waiting")}


def _fresh_request_is_right(cast: dict) -> None:
    status, body = _post(cast["proxy"].url + "/v1/completions", GREEDY)
    assert status == 200 and body["choices"][0]["text"] == cast["want"], body


def _decode_leg(dec: Server, params: dict, timeout: float = 30) -> tuple[int, dict, float]:
    """Leg 2 straight to a decode server: (status, body, seconds it took)."""
    start = time.monotonic()
    status, body = _post(dec.url + "/v1/completions", dict(GREEDY, kv_transfer_params=params), timeout=timeout)
    return status, body, time.monotonic() - start


def _wait_read_posted(dec: Server, timeout: float = 10.0) -> None:
    """Until the decode has a READ in flight (its rank 0 heartbeat says so)."""
    _settles(dec, timeout=timeout, pending_transfers=1)


def test_the_proxy_answers_tokenize_and_detokenize_like_a_server(cast):
    """Token-counting clients (ringserve bench) calibrate through these: the proxy must pass them
    on (it answered 404, and the bench then guessed its prompts twice too long)."""
    proxy, d2 = cast["proxy"], cast["d2"]
    ask = {"model": "tiny", "prompt": "Tell me about the sliding window."}
    status, through = _post(proxy.url + "/tokenize", ask)
    assert status == 200 and through == _post(d2.url + "/tokenize", ask)[1], through
    status, text = _post(proxy.url + "/detokenize", {"model": "tiny", "tokens": through["tokens"]})
    assert status == 200 and text == _post(d2.url + "/detokenize", {"model": "tiny", "tokens": through["tokens"]})[1]


def test_a_prefill_stalled_during_the_read_times_it_out_and_the_pair_recovers(cast):
    """P1's worker stops with D2's READ posted: D2 answers 503 once its 1.5 s READ timeout
    fires and frees its blocks at once; P1, resumed, lets the unread lease expire; D2 then
    reconnects to P1 and decodes from it again."""
    p1, d2 = cast["p1"], cast["d2"]
    status, body, _ = _decode_leg(d2, _leg1(p1, PROMPT))  # connect D2 to P1: the stall hits the READ
    assert status == 200 and body["choices"][0]["text"] == cast["want"], body
    failed, expired = _kv(d2)["failed"], _kv(p1)["expired"]
    params = _leg1(p1, PROMPT)
    worker = workers(p1.proc.pid)[0]
    stop_process(worker)
    try:
        status, body, took = _decode_leg(d2, params)
        _settles(d2, failed=failed + 1, loads=0, pending_transfers=0, held_blocks=0, kv_blocks_used=0)
    finally:
        os.kill(worker, signal.SIGCONT)
    assert status == 503 and "timed out" in body["error"]["message"], body
    assert 1.4 < took < 8, took
    _settles(p1, timeout=15, expired=expired + 1, leases=0)  # nobody could tell it: the lease ran out
    _idle(p1, d2)
    status, body, _ = _decode_leg(d2, _leg1(p1, PROMPT))
    assert status == 200 and body["choices"][0]["text"] == cast["want"], body
    _idle(p1, d2)
    _fresh_request_is_right(cast)


def test_a_prefill_killed_during_the_read_fails_it_fast_and_the_proxy_moves_on(cast):
    """P1 is SIGKILLed, whole process group, with D1's READ of its blocks in flight and a
    proxy request's leg 1 inside it (both held there by stopping P1's worker first): D1 sees the
    disconnect and answers 503 well inside its 10 s READ timeout; the proxy sends the leg 1 that
    P1 took down with it to P2, and its client gets the right answer."""
    proxy, p1, d1, p2 = cast["proxy"], cast["p1"], cast["d1"], cast["p2"]
    status, body, _ = _decode_leg(d1, _leg1(p1, PROMPT))  # connected, so the kill hits the READ
    assert status == 200, body
    failed = _kv(d1)["failed"]
    params = _leg1(p1, PROMPT)
    worker = workers(p1.proc.pid)[0]
    dead = [p1.proc.pid, worker]
    stop_process(worker)
    try:
        with _Background(lambda: _post(d1.url + "/v1/completions", dict(GREEDY, kv_transfer_params=params))) as leg2, \
                _Background(lambda: _post(proxy.url + "/v1/completions", GREEDY)) as through:
            _wait_read_posted(d1)
            time.sleep(2.0)  # for the proxy's leg 1 to reach P1 (nothing to poll: P1's engine is stopped)
            os.killpg(p1.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            status, body = leg2.result(timeout=15)
            took = time.monotonic() - killed
            answered = through.result(timeout=30)
    finally:
        if p1.proc.poll() is None:
            os.killpg(p1.proc.pid, signal.SIGKILL)
    assert status == 503 and "KV transfer from prefill" in body["error"]["message"], body
    assert "timed out" not in body["error"]["message"] and took < 5, (took, body)
    assert answered[0] == 200 and answered[1]["choices"][0]["text"] == cast["want"], answered
    assert f"prefill {p1.url} failed mid-request (ServerDisconnectedError); trying another" in proxy.output()
    assert p1.proc.wait(15) == -signal.SIGKILL
    _settles(d1, failed=failed + 1)
    _idle(d1, p2)
    _fresh_request_is_right(cast)  # P1 refuses connections: leg 1 goes to P2
    _idle(d1, p2)
    assert all_gone(dead)
    _remove_rings_of_dead(p1.proc.pid)


def test_a_decode_killed_mid_stream_ends_the_proxys_stream_with_an_error_then_done(cast):
    """D1 (the proxy's first pick) is SIGKILLed, whole process group, while it streams a
    900-token answer through the proxy and READs another request's blocks from P2 (held in
    flight by stopping P2's worker): the proxy's stream ends with its error event and [DONE] at
    once; P2, resumed, lets the unread lease run out (the streamed request's was released when
    its READ completed); the proxy routes the next request to D2."""
    proxy, d1, d2, p2 = cast["proxy"], cast["d1"], cast["d2"], cast["p2"]
    status, body, _ = _decode_leg(d1, _leg1(p2, PROMPT))  # connected, so the kill hits a READ
    assert status == 200, body
    expired = _kv(p2)["expired"]
    body = dict(GREEDY, max_tokens=900, stream=True)
    req = urllib.request.Request(proxy.url + "/v1/completions", json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    events, killed, dead = [], None, [d1.proc.pid, *workers(d1.proc.pid)]
    worker = workers(p2.proc.pid)[0]
    with _Background(lambda: _post(cast["only_d1"].url + "/v1/completions", dict(GREEDY, max_tokens=900))) as plain:
        _settles_metric(d1, "running", 1)
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.headers["x-pd-decode-server"] == d1.url
            for line in r:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if len(events) == 3:
                        killed = _kill_while_reading(d1, p2, worker)
        status, answer = plain.result(timeout=10)
    # the non-streamed request: a JSON error that names the cause, not a bare 500
    assert status == 502 and answer["error"]["code"] == "decode_failed", (status, answer)
    assert d1.url in answer["error"]["message"], answer
    took = time.monotonic() - killed
    assert events[-1] == b"[DONE]" and took < 5, (took, events[-3:])
    error = json.loads(events[-2])["error"]
    assert error["code"] == "decode_failed" and d1.url in error["message"], error
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert len(events) < 900  # it did stop early
    d1.proc.wait(10)
    _settles(p2, timeout=15, expired=expired + 1)  # one lease ran out: the stream's was released
    _idle(p2, d2)
    _fresh_request_is_right(cast)
    _idle(p2, d2)
    assert all_gone(dead)
    _remove_rings_of_dead(d1.proc.pid)


def _kill_while_reading(dec: Server, pre: Server, pre_worker: int) -> float:
    """Give `dec` a READ from `pre` that cannot finish (pre's worker stopped), SIGKILL `dec`'s
    process group, resume `pre`; returns when the kill was sent."""
    params = _leg1(pre, PROMPT)
    stop_process(pre_worker)
    try:
        with _Background(lambda: _post(dec.url + "/v1/completions", dict(GREEDY, kv_transfer_params=params))) as leg2:
            _wait_read_posted(dec)
            os.killpg(dec.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(OSError):  # the connection dies with the server: no answer
                leg2.result(timeout=15)
    finally:
        os.kill(pre_worker, signal.SIGCONT)
    return killed


def _remove_rings_of_dead(pid: int) -> None:
    """A SIGKILLed server cannot unlink its rings; the next `serve` on this machine removes them
    (ipc.segment.remove_orphans, for every owner pid that is gone). Check this one's owner is
    gone, then do that for its rings only (other users' files are not this test's)."""
    from ipc.segment import SHM_DIR

    assert all_gone([pid])
    for name in segments_of(pid):
        os.unlink(os.path.join(SHM_DIR, name))


class _Background:
    """Run one call on a thread; `result()` waits for its return value."""

    def __init__(self, fn):
        import threading

        self._fn, self._out = fn, None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._out = ("ok", self._fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in result()
            self._out = ("err", exc)

    def __enter__(self) -> "_Background":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._thread.join(30)

    def result(self, timeout: float):
        self._thread.join(timeout)
        assert self._out is not None, f"no answer within {timeout} s"
        kind, value = self._out
        if kind == "err":
            raise value
        return value
