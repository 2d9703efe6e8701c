"""Overload, disconnect storms, SIGTERM drain, worker death and systemd notifications."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from process_state import stop_process
from server_process import Server, children as _children, segments_of as _segments_of, workers as _workers

HEADERS = {"Authorization": "Bearer test-key-123"}
LONG = {"prompt": "go", "max_tokens": 900, "ignore_eos": True, "stream": True}


def _metric(server, name: str) -> float:
    status, body = server.get("/metrics", "test-key-123")
    for line in body["text"].splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def _first_chunk_then(session, url, body, after):
    async with session.post(url + "/v1/completions", json=body, headers=HEADERS) as resp:
        if resp.status != 200:
            return resp.status, dict(resp.headers), await resp.text()
        await resp.content.readline()
        return await after(resp)


def test_overload_is_429_with_retry_after(model_dir):
    # The per-sequence eager path: the compiled CPU step ran the first 900 tokens (and then the queued
    # request's) within the second this test waits, leaving no queue to overflow.
    server = Server(model_dir, "--max-num-seqs", "1", "--max-queued-requests", "1", "--enforce-eager")
    try:
        async def main():
            async with aiohttp.ClientSession() as s:
                async def hold(resp):  # the running stream, then the queued one once it runs
                    await asyncio.sleep(3.0)
                    return 200, {}, ""
                tasks = [asyncio.ensure_future(_first_chunk_then(s, server.url, LONG, hold)) for _ in range(2)]
                await asyncio.sleep(1.0)
                t0 = time.monotonic()
                async with s.post(server.url + "/v1/completions", json=LONG, headers=HEADERS) as resp:
                    body = await resp.json()
                    status, retry, took = resp.status, resp.headers.get("Retry-After"), time.monotonic() - t0
                await asyncio.gather(*tasks)
                return status, retry, took, body
        status, retry, took, body = asyncio.run(main())
        # at once: a queued one would first wait for the held streams (≥ 2 s more), then for its own
        # 900 eager tokens (seconds) before its whole body is read
        assert status == 429 and retry is not None and took < 3.0
        assert body["error"]["type"] == "rate_limit_error"
    finally:
        assert server.stop() == 0


def test_disconnect_storm_leaves_nothing_behind(model_dir):
    """200 clients asking for 900 tokens each vanish: far more aborts than the request ring has
    slots, while it is full of submissions. Every abort lands (none is dropped or waits on
    submissions), so running requests and KV use return to zero within seconds, and each
    disconnect costs the log at most one line."""
    server = Server(model_dir, "--max-num-seqs", "8", "--max-queued-requests", "1000")
    storm = 200
    try:
        async def main():
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as s:
                async def drop(resp):
                    resp.close()  # vanish mid-stream
                    return 200, {}, ""

                async def one(i):
                    if i % 2:
                        return await _first_chunk_then(s, server.url, LONG, drop)
                    try:  # non-streaming clients that give up
                        await asyncio.wait_for(s.post(server.url + "/v1/completions", headers=HEADERS,
                                                      json={**LONG, "stream": False}), timeout=0.3)
                    except asyncio.TimeoutError:
                        pass
                    return 200, {}, ""
                await asyncio.gather(*(one(i) for i in range(storm)))
        asyncio.run(main())
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            time.sleep(1.2)  # metrics refresh once a second from heartbeats
            if (_metric(server, "ringserve:num_requests_running") == 0
                    and _metric(server, "ringserve:num_requests_waiting") == 0
                    and _metric(server, "ringserve:kv_cache_usage_perc") == 0):
                break
        else:
            pytest.fail("requests or KV blocks were still held after the storm")
        assert _metric(server, "ringserve:http_requests_client_disconnected_total") > 0
        status, body = server.get("/health")
        assert status == 200
        import openai

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="test-key-123", max_retries=0)
        assert client.completions.create(model="tiny", prompt="after", max_tokens=3).choices[0].text is not None
        log = server.output()
        assert "Traceback" not in log and "abort" not in log.lower(), log[-3000:]
    finally:
        assert server.stop() == 0


def test_sigterm_drains_then_aborts_and_cleans_up(model_dir, tmp_path):
    notify = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(0.1)
    # The streams must still be running when the drain ends, whatever the machine's speed (a quiet
    # one decodes 900 tiny-model tokens within a second): the worker is stopped once both streams
    # have started, and let go only after the drain has run out, when the server has told it to stop.
    server = Server(model_dir, "--drain-timeout", "0.8", env={"NOTIFY_SOCKET": str(notify)})
    worker = _workers(server.proc.pid)[0]
    messages = []
    try:
        async def main():
            async with aiohttp.ClientSession() as s:
                started = [asyncio.Event(), asyncio.Event()]

                async def read_rest(resp, started):
                    started.set()
                    finish = None
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            choice = json.loads(line[6:])["choices"]
                            if choice and choice[0]["finish_reason"]:
                                finish = choice[0]["finish_reason"]
                    return finish
                streams = [asyncio.ensure_future(_first_chunk_then(s, server.url, LONG, lambda r, e=e: read_rest(r, e)))
                           for e in started]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
                stop_process(worker)
                try:
                    os.kill(server.proc.pid, signal.SIGTERM)
                    await asyncio.sleep(0.2)
                    async with s.get(server.url + "/ready") as r:
                        ready = r.status
                    async with s.post(server.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2},
                                      headers=HEADERS) as r:
                        late = r.status
                    await asyncio.sleep(1.3)  # past the 0.8 s drain: the server is shutting the worker down
                finally:
                    os.kill(worker, signal.SIGCONT)
                return ready, late, await asyncio.gather(*streams)
        ready, late, finishes = asyncio.run(main())
        assert ready == 503 and late == 503
        assert finishes == ["abort", "abort"]
        assert server.proc.wait(timeout=60) == 0
    finally:
        code = server.stop()
        while True:
            try:
                messages.append(sock.recv(4096).decode())
            except OSError:
                break
        sock.close()
    assert code == 0
    assert any(m.startswith("READY=1") for m in messages) and any("STOPPING=1" in m for m in messages)
    assert not _children(server.proc.pid) and not _segments_of(server.proc.pid)


def test_ctrl_c_to_the_process_group_shuts_down_cleanly(model_dir):
    """A terminal's Ctrl-C reaches the server and its workers at once: the server still drains
    and stops its workers itself, and no process prints a KeyboardInterrupt traceback."""
    server = Server(model_dir)
    try:
        assert len(_workers(server.proc.pid)) == 1
        os.killpg(server.proc.pid, signal.SIGINT)  # the server runs in its own session
        code = server.proc.wait(timeout=60)
        log = server.output()
    finally:
        server.stop()
    assert code == 0, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert not _children(server.proc.pid) and not _segments_of(server.proc.pid)


def test_dead_worker_fails_health_and_exits_nonzero(model_dir):
    server = Server(model_dir)
    try:
        workers = _workers(server.proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        saw_503 = False
        while time.monotonic() < deadline and server.proc.poll() is None:
            try:
                saw_503 |= server.get("/health")[0] == 503
            except OSError:
                break
            time.sleep(0.05)
        assert server.proc.wait(timeout=60) == 1
        assert saw_503 or server.proc.returncode == 1
    finally:
        server.stop()
    assert not _segments_of(server.proc.pid)


def test_systemd_unit_verifies(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "server.cli", "systemd-unit", "--", "--port", "9000", "--dp", "2",
                           "--drain-timeout", "45"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    unit = proc.stdout
    for line in ("Type=notify", "Restart=on-failure", "KillMode=mixed", "LimitMEMLOCK=infinity", "WatchdogSec="):
        assert line in unit
    assert "PrivateDevices" not in unit
    stop = int(next(l for l in unit.splitlines() if l.startswith("TimeoutStopSec=")).split("=")[1])
    assert stop >= 45
    bad = subprocess.run([sys.executable, "-m", "server.cli", "systemd-unit", "--", "--port", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    node = subprocess.run([sys.executable, "-m", "server.cli", "systemd-unit", "--role", "headless", "--", "--dp", "4",
                           "--data-parallel-size-local", "2", "--data-parallel-start-rank", "2",
                           "--enable-expert-parallel"], capture_output=True, text=True, timeout=60)
    assert node.returncode == 0 and "ringserve-node.service" in node.stdout, node.stderr
    assert " serve --dp 4" in node.stdout and node.stdout.rstrip().count("--headless") == 1
    mismatch = subprocess.run([sys.executable, "-m", "server.cli", "systemd-unit", "--role", "head", "--", "--dp", "2"],
                              capture_output=True, text=True, timeout=60)
    assert mismatch.returncode == 2 and "does not match" in mismatch.stderr


def test_broken_checkpoint_fails_fast_with_one_line(model_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", str(broken), "--port", "0",
                             "--kv-cache-memory", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    lines = [l for l in err.splitlines() if l.startswith("ringserve: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "model.safetensors" in lines[0], err
    assert not _segments_of(proc.pid) and not _children(proc.pid)


def test_slowloris_and_connection_cap(model_dir):
    """Connections that trickle a request head are closed after --header-timeout; past
    --max-connections a new connection gets 503 JSON at once; the server then serves normally."""
    server = Server(model_dir, "--header-timeout", "1", "--max-connections", "20")
    try:
        slow = []
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
            slow.append(s)
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        reply = extra.recv(65536)
        extra.close()
        assert reply.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in reply, reply
        t0 = time.monotonic()
        closed = 0
        for s in slow:  # keep trickling: the deadline is on the head, not on silence
            try:
                for _ in range(30):
                    s.sendall(b"X")
                    s.settimeout(0.1)
                    try:
                        if s.recv(1024) == b"":
                            closed += 1
                            break
                    except socket.timeout:
                        continue
            except OSError:
                closed += 1
            finally:
                s.close()
        assert closed == 20 and time.monotonic() - t0 < 20
        assert server.get("/v1/models", "test-key-123")[0] == 200
    finally:
        assert server.stop() == 0
