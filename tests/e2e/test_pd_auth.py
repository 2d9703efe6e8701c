"""Issue 38, finding 5, with real processes on loopback: a prefill and a decode server sharing a
cluster key. The KV side channel (which hands out the prefill's NIXL metadata, memory keys
included) answers only holders of the key; kv_transfer_params are signed, so a client that
talks to the decode directly cannot forge or alter them; every listener stays on 127.0.0.1;
and without a key a PD server refuses to listen off loopback."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed: PD disaggregation needs NIXL")

import zmq  # noqa: E402

from listeners import listening, process_tree  # noqa: E402
from pd_engines import UCX_ENV  # noqa: E402
from server_process import API_KEY, Server, segments_of  # noqa: E402

COMMON = ("--max-num-seqs", "4", "--kv-transfer-timeout", "10", "--kv-connect-timeout", "3")


class _Deferred(Server):
    """Readiness awaited later, so that both servers boot at once (2 shared cores)."""

    def wait_ready(self, timeout: float = 120.0) -> None:
        if getattr(self, "_boot", False):
            super().wait_ready(timeout)
        self._boot = True


@pytest.fixture(scope="module")
def keyed_pd(model_dir, tmp_path_factory):
    key = tmp_path_factory.mktemp("key") / "cluster.key"
    subprocess.run([sys.executable, "-m", "server.cli", "cluster-key", "--out", str(key)], check=True,
                   capture_output=True, timeout=60)
    env = {**UCX_ENV, "RINGSERVE_CLUSTER_KEY_FILE": str(key)}  # the environment route, this time
    servers = []
    try:
        servers.append(_Deferred(model_dir, *COMMON, "--kv-role", "prefill", "--kv-transfer", "nixl", env=env))
        servers.append(_Deferred(model_dir, *COMMON, "--kv-role", "decode", "--kv-transfer", "nixl", env=env))
        for s in servers:
            s.wait_ready()
        yield servers
        for s in servers:
            pid = s.proc.pid
            assert s.stop() == 0, s.output()
            assert not segments_of(pid)
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.proc.kill()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _leg1(pre: Server, prompt: list[int]) -> dict:
    status, body = _post(pre.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                       "temperature": 0,
                                                       "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, body
    return body["kv_transfer_params"]


def _leg2(dec: Server, prompt: list[int], params: dict) -> tuple[int, dict]:
    return _post(dec.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                               "temperature": 0, "kv_transfer_params": params})


def test_signed_params_carry_a_request_across_and_forged_ones_are_refused(keyed_pd):
    pre, dec = keyed_pd
    prompt = list(range(1, 30))
    params = _leg1(pre, prompt)
    assert len(params["params_mac"]) == 64
    # What a client talking to the decode directly could try with params it saw: other blocks
    # (another request's KV), another listener, or no signature at all.
    full, sliding = params["remote_block_ids"]
    for forged in (dict(params, remote_block_ids=[full[::-1], sliding]),
                   dict(params, remote_port=params["remote_port"] + 1),
                   {k: v for k, v in params.items() if k != "params_mac"}):
        status, body = _leg2(dec, prompt, forged)
        assert status == 400 and "params_mac" in body["error"]["message"], body
    status, body = _leg2(dec, prompt, params)  # the genuine params still work after the forgeries
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body


def test_the_side_channel_answers_no_one_without_the_key_and_listeners_stay_on_loopback(keyed_pd):
    pre, dec = keyed_pd
    params = _leg1(pre, list(range(1, 20)))
    port = params["remote_port"]
    ctx = zmq.Context()
    try:
        keyless = ctx.socket(zmq.DEALER)  # speaks ZeroMQ, without the key
        keyless.setsockopt(zmq.LINGER, 0)
        keyless.connect(f"tcp://127.0.0.1:{port}")
        keyless.send(b"\x92\x01\xc4\x00")  # anything: it never gets past the handshake
        answered = keyless.poll(2000)
    finally:
        ctx.destroy(linger=0)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # not ZeroMQ at all
        raw.sendall(os.urandom(4096))
        raw.settimeout(2)
        try:
            got = raw.recv(65536)
        except (socket.timeout, ConnectionResetError):
            got = b""
    assert not answered and b"nixl" not in got.lower() and len(got) <= 64  # at most ZeroMQ's greeting
    deadline = time.monotonic() + 5  # the refusal is logged (at most once a second)
    while "kv-side-channel: refused" not in pre.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "kv-side-channel: refused" in pre.output(), pre.output()[-3000:]
    for server in (pre, dec):
        addresses = {addr for addr, _, _ in listening(process_tree(server.proc.pid))}
        assert addresses == {"127.0.0.1"}, addresses
    # The decode still reads from the prefill after all that.
    prompt = list(range(3, 25))
    status, body = _leg2(dec, prompt, _leg1(pre, prompt))
    assert status == 200, body


@pytest.mark.parametrize("flags", [("--kv-role", "prefill", "--kv-transfer-host", "10.1.2.3"),
                                   ("--kv-role", "decode", "--host", "0.0.0.0")])
def test_without_a_key_a_pd_server_refuses_to_listen_off_loopback(flags):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_CLUSTER_KEY")}
    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--kv-transfer", "nixl", *flags],
                          capture_output=True, text=True, timeout=120, env=env)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "no cluster key" in last and "--insecure-cluster" in last, proc.stderr[-2000:]
