"""Faults injected into a real `ringserve serve`: corrupt ring slots in both directions, a stopped
worker, a killed worker mid-stream. Each must be loud: requests fail with the cause, /health turns
503, and a rank that cannot be trusted takes the server down (exit 1) so the supervisor restarts it."""

from __future__ import annotations

import json
import mmap
import os
import signal
import threading
import time
import urllib.request

import pytest

from ipc import ring_layout as L
from ipc.segment import SHM_DIR

from process_state import all_gone, stop_process
from server_process import Server, segments_of as _segments_of, workers as _workers

HEADERS = {"Authorization": "Bearer test-key-123", "Content-Type": "application/json"}


def _ring_header(name: str) -> dict:
    with open(os.path.join(SHM_DIR, name), "rb") as f:
        head = f.read(L.CTRL_BYTES)
    q = memoryview(head).cast("Q")
    i = memoryview(head).cast("I")
    return {"slot_bytes": i[L.OFF_SLOT_BYTES // 4], "num_slots": i[L.OFF_NUM_SLOTS // 4],
            "writer": i[L.OFF_WRITER_PID // 4], "reader": i[L.OFF_READER_PID // 4],
            "written": q[L.OFF_WRITE_COUNT // 8], "read": q[L.OFF_READ_COUNT // 8]}


def _ring(server_pid: int, writer: int, reader: int, min_slot_bytes: int) -> str:
    """The ring of `server_pid` written by `writer` and read by `reader` (the request or output
    ring: control and status rings have small slots)."""
    for name in _segments_of(server_pid):
        if name.endswith((".rd", ".wr")):
            continue
        h = _ring_header(name)
        if h["writer"] == writer and h["reader"] == reader and h["slot_bytes"] >= min_slot_bytes:
            return name
    raise AssertionError("ring not found")


def _corrupt_unread(name: str, deadline_s: float = 20.0) -> int:
    """Flip payload bytes of every published slot the reader has not consumed; returns how many."""
    end = time.monotonic() + deadline_s
    while True:
        h = _ring_header(name)
        if h["written"] > h["read"] or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert h["written"] > h["read"], "nothing published and unread to corrupt"
    with open(os.path.join(SHM_DIR, name), "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        for seq in range(h["read"] + 1, h["written"] + 1):
            at = L.CTRL_BYTES + (seq - 1) % h["num_slots"] * h["slot_bytes"] + L.SLOT_HEADER_BYTES + 1
            m[at] ^= 0x5A
    return h["written"] - h["read"]


def _post(server, body: dict, results: list) -> None:
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(), HEADERS)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            results.append((r.status, json.loads(r.read())))
    except urllib.error.HTTPError as e:
        results.append((e.code, json.loads(e.read() or b"{}")))
    except OSError as e:
        results.append((0, {"error": {"message": str(e)}}))


def _exit_code(server, timeout: float = 60) -> int:
    return server.proc.wait(timeout=timeout)


def _wait_health(server, status: int, timeout: float) -> float:
    """Seconds until /health answers `status` (or the server is gone, for 503)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if server.get("/health")[0] == status:
                return time.monotonic() - t0
        except OSError:
            if status == 503:
                return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"/health never answered {status}")


def test_corrupt_request_ring_slot_fails_its_requests_and_the_server(model_dir):
    server = Server(model_dir, "--dp", "2")
    try:
        victim = _workers(server.proc.pid)[0]
        ring = _ring(server.proc.pid, writer=server.proc.pid, reader=victim, min_slot_bytes=1 << 20)
        stop_process(victim)  # its request ring fills with published, unread Submits
        results: list = []
        threads = [threading.Thread(target=_post, args=(server, {"prompt": f"p{i}", "max_tokens": 4}, results))
                   for i in range(6)]
        for t in threads:
            t.start()
        corrupted = _corrupt_unread(ring)
        os.kill(victim, signal.SIGCONT)
        for t in threads:
            t.join(timeout=120)
        code = _exit_code(server)
        log = server.output()
    finally:
        server.stop()
    assert corrupted >= 1
    failed = [body["error"]["message"] for status, body in results if status != 200]
    corrupt = [m for m in failed if "corrupt ring slot (crc)" in m and "request ring" in m]
    assert corrupt, results  # the victim's requests were never silently lost: they name the cause
    # The others were in flight on the healthy rank when the server went down for its restart.
    assert all(m in corrupt or m == "server shutting down" for m in failed), failed
    assert code == 1, log  # a rank that cannot be trusted takes the server down for a restart
    assert not _segments_of(server.proc.pid)


def test_corrupt_output_ring_slot_fails_its_requests_and_the_server(model_dir):
    server = Server(model_dir)
    try:
        worker = _workers(server.proc.pid)[0]
        ring = _ring(server.proc.pid, writer=worker, reader=server.proc.pid, min_slot_bytes=1 << 20)
        results: list = []
        client = threading.Thread(target=_post, args=(server, {"prompt": "long", "max_tokens": 600,
                                                               "ignore_eos": True}, results))
        client.start()
        end = time.monotonic() + 60
        while _ring_header(ring)["written"] < 2 and time.monotonic() < end:
            time.sleep(0.005)  # until it generates: the compiled CPU step writes 600 tokens in well under 1 s
        stop_process(server.proc.pid)  # the front process stops reading; the worker writes on
        try:
            corrupted = _corrupt_unread(ring)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        client.join(timeout=120)
        code = _exit_code(server)
        log = server.output()
    finally:
        server.stop()
    assert corrupted >= 1
    assert results and results[0][0] == 503, results
    message = results[0][1]["error"]["message"]
    assert "output ring failed" in message and "CorruptSlot" in message, message
    assert code == 1, log
    assert not _segments_of(server.proc.pid)


def test_a_stopped_worker_is_noticed_within_seconds(model_dir):
    server = Server(model_dir, "--worker-liveness-timeout", "1")
    try:
        worker = _workers(server.proc.pid)[0]
        os.kill(worker, signal.SIGSTOP)
        try:
            noticed = _wait_health(server, 503, timeout=10)
        finally:
            os.kill(worker, signal.SIGCONT)
        recovered = _wait_health(server, 200, timeout=10)  # a resumed worker answers again
        log = server.output()
    finally:
        assert server.stop() == 0
    assert noticed < 1 + 2.0, noticed  # the timeout, plus a watchdog tick or two
    assert recovered < 5
    assert "rank 0 stuck: no heartbeat" in log


def test_killed_worker_ends_streams_with_the_cause(model_dir):
    server = Server(model_dir)
    try:
        worker = _workers(server.proc.pid)[0]
        req = urllib.request.Request(server.url + "/v1/completions", json.dumps(
            {"prompt": "go", "max_tokens": 900, "ignore_eos": True, "stream": True}).encode(), HEADERS)
        events = []
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if len(events) == 2:
                        os.kill(worker, signal.SIGKILL)
        code = _exit_code(server)
    finally:
        server.stop()
    assert events[-1] == b"[DONE]"
    finish = json.loads(events[-3])["choices"][0]["finish_reason"]
    error = json.loads(events[-2])["error"]
    assert finish == "error" and "worker rank 0 died" in error["message"] and error["type"] == "server_error"
    assert code == 1


def test_a_killed_expert_parallel_rank_takes_the_whole_group_down(model_dir):
    """kill -9 of one rank of an EP group mid-stream: the other fails in its next collective and
    exits too, the stream ends with the cause, the server exits 1, nothing is left in /dev/shm."""
    server = Server(model_dir, "--dp", "2", "--enable-expert-parallel")
    try:
        workers = _workers(server.proc.pid)
        assert len(workers) == 2
        req = urllib.request.Request(server.url + "/v1/completions", json.dumps(
            {"prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}).encode(), HEADERS)
        events, t0 = [], None
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if len(events) == 2:
                        t0 = time.monotonic()
                        os.kill(workers[1], signal.SIGKILL)
        code = _exit_code(server)
        took = time.monotonic() - t0
        log = server.output()
    finally:
        server.stop()
    assert code == 1, log
    assert took < 30, took  # within the collective timeout; in practice the peer's socket closes at once
    assert all_gone(workers)
    error = json.loads(events[-2])["error"]
    assert events[-1] == b"[DONE]" and "died" in error["message"], events[-3:]
    assert not _segments_of(server.proc.pid)
