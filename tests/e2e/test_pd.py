"""Prefill/decode disaggregation with real processes on loopback: a `--kv-role prefill` server, a
`--kv-role decode` server and `ringserve proxy` in front of them, NIXL over UCX tcp, against a
plain colocated `ringserve serve` of the same weights as the reference.

The official `openai` client talks to the proxy; greedy output must equal the colocated
server's. The faults run last (the final one kills the prefill server): after each, neither side
holds a KV block, a lease or a load, and every process exits cleanly leaving no shared memory.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed: PD disaggregation needs NIXL")
openai = pytest.importorskip("openai", reason="the official openai client is not installed")

from pd_engines import UCX_ENV  # noqa: E402
from server_process import API_KEY, Server, children, free_port, segments_of  # noqa: E402

COMMON = ("--max-num-seqs", "4", "--kv-transfer-timeout", "10", "--kv-connect-timeout", "2")
GREEDY = dict(temperature=0, max_tokens=6, extra_body={"ignore_eos": True})


class _Deferred(Server):
    """A Server whose readiness is awaited later, so that all of them boot at once."""

    def wait_ready(self, timeout: float = 120.0) -> None:
        if getattr(self, "_boot", False):
            super().wait_ready(timeout)
        self._boot = True


class Proxy:
    def __init__(self, log_dir, prefill: list[str], decode: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"proxy-{self.port}.log", "w+")
        cmd = [sys.executable, "-m", "server.cli", "proxy", "--port", str(self.port), "--prefill", *prefill,
               "--decode", *decode, "--drain-timeout", "5"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        status, body = 0, {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            status, body = _get(self.url + "/ready")
            if status == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(f"proxy not ready ({status} {body}): {self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        finally:
            self.log.close()


def _get(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except OSError as e:
        return 0, {"error": str(e)}


def _post(url: str, body: dict, key: str | None = API_KEY, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _kv(server: Server) -> dict:
    """Rank 0's connector state and KV block use (from its latest heartbeat)."""
    status, body = server.get("/kv_transfer/stats", API_KEY)
    assert status == 200, body
    rank = body["ranks"][0]
    return {**rank["kv_transfer"], "kv_blocks_used": rank["kv_blocks_used"]}


def _settles(server: Server, timeout: float = 10.0, **want) -> dict:
    """Wait until the server's KV state shows `want` (heartbeats lag a little); returns it."""
    deadline = time.monotonic() + timeout
    while True:
        got = _kv(server)
        if all(got[k] == v for k, v in want.items()) or time.monotonic() > deadline:
            assert {k: got[k] for k in want} == want, got
            return got
        time.sleep(0.1)


def _holds_nothing(*servers: Server, timeout: float = 10.0) -> None:
    """Every rank of each server: no lease, no load, no held or used KV block, no READ pending."""
    want = dict(leases=0, loads=0, held_blocks=0, pending_transfers=0)
    for s in servers:
        deadline = time.monotonic() + timeout
        while True:
            ranks = s.get("/kv_transfer/stats", API_KEY)[1]["ranks"]
            got = [({k: r["kv_transfer"][k] for k in want}, r["kv_blocks_used"]) for r in ranks]
            if all(g == (want, 0) for g in got) or time.monotonic() > deadline:
                assert all(g == (want, 0) for g in got), (s.url, got)
                break
            time.sleep(0.1)


def _stop_cleanly(server: Server) -> None:
    """SIGTERM one server: it exits 0 and leaves no shared-memory segment or child behind."""
    pid = server.proc.pid
    assert server.stop() == 0, server.output()
    assert not segments_of(pid) and not children(pid), server.output()


def _kill_leftovers(procs) -> None:
    """After a failed setup or test: SIGKILL whatever still runs, whole process groups."""
    for p in procs:
        if p.proc.poll() is None:
            os.killpg(p.proc.pid, signal.SIGKILL)


def pd_servers(model_dir, common: tuple[str, ...], pre_flags: tuple[str, ...] = (), some_may_be_killed: bool = False):
    """Generator for a fixture: (proxy, prefill, decode, colocated) booted together (2 shared
    cores: this dominates), then each stopped cleanly — but a server a test killed, when
    `some_may_be_killed` — and whatever still runs after a failure killed."""
    procs: list = []
    try:
        pre = _Deferred(model_dir, *common, "--kv-role", "prefill", "--kv-transfer", "nixl", *pre_flags)
        procs.append(pre)
        dec = _Deferred(model_dir, *common, "--kv-role", "decode", "--kv-transfer", "nixl")
        procs.append(dec)
        col = _Deferred(model_dir, *common)
        procs.append(col)
        proxy = Proxy(model_dir.parent, [pre.url], [dec.url])
        procs.append(proxy)
        for p in procs:
            p.wait_ready()
        yield proxy, pre, dec, col
        assert proxy.stop() == 0, proxy.output()
        for s in (pre, dec, col):
            if not some_may_be_killed or s.proc.poll() is None:
                _stop_cleanly(s)
    finally:
        _kill_leftovers(procs)


@pytest.fixture(scope="module")
def pd(model_dir):
    """(proxy, prefill, decode, colocated); the last fault test kills the prefill."""
    os.environ.update(UCX_ENV)  # inherited by every child; a no-op for the other e2e servers
    yield from pd_servers(model_dir, COMMON, ("--kv-lease-timeout", "3"), some_may_be_killed=True)


def _client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


# ---- output --------------------------------------------------------------------------------
# tiny: window 8, compress ratios 4 and 8, blocks of 16 → a prompt inside one window (partial
# compressor state only), and one spanning three blocks with partial records of both ratios.
@pytest.mark.parametrize("n", [5, 42])
def test_greedy_completions_through_the_proxy_equal_colocated(pd, model_dir, n):
    proxy, pre, dec, col = pd
    prompt = [(7 * i + 3) % 250 + 1 for i in range(n)]
    want = _client(col.url).completions.create(model="tiny", prompt=prompt, logprobs=1, **GREEDY)
    loaded = _kv(dec)["loaded"]
    got = _client(proxy.url).completions.create(model="tiny", prompt=prompt, logprobs=1, **GREEDY)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.choices[0].logprobs.token_logprobs,
                                                                   abs=1e-4)
    assert got.usage.prompt_tokens == n and got.usage.completion_tokens == 6
    stats = _settles(dec, loaded=loaded + 1)
    assert stats["last_bytes"] == _planned_bytes(model_dir, n)  # exactly the plan's spans crossed
    _holds_nothing(pre, dec)


def test_structured_output_through_the_proxy_equals_colocated(pd):
    """A JSON schema across PD: the prefill samples the first token under the grammar, the
    decode leg's matcher continues from it; the output validates and equals the colocated one."""
    import jsonschema

    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tag": {"enum": ["alpha", "beta"]}}, "required": ["id", "tag"]}
    kw = dict(model="tiny", prompt="Record:", max_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    want = _client(pd[3].url).completions.create(**kw).choices[0]
    got = _client(pd[0].url).completions.create(**kw).choices[0]
    assert got.text == want.text and got.finish_reason == want.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), schema)
    _holds_nothing(pd[1], pd[2])


def test_chat_streaming_and_not_through_the_proxy_equal_colocated(pd):
    proxy, pre, dec, col = pd
    messages = [{"role": "user", "content": "Tell me about the sliding window, in a few words please."}]
    want = _client(col.url).chat.completions.create(model="tiny", messages=messages, **GREEDY)
    got = _client(proxy.url).chat.completions.create(model="tiny", messages=messages, **GREEDY)
    said = want.choices[0].message
    assert said.reasoning_content or said.content  # thinking is on by default: the reasoning carries the text
    assert (got.choices[0].message.reasoning_content, got.choices[0].message.content) == (said.reasoning_content,
                                                                                         said.content)
    chunks = _client(proxy.url).chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (said.reasoning_content or "")
    assert "".join(d.content or "" for d in deltas) == said.content
    _holds_nothing(pre, dec)


def _planned_bytes(model_dir, n: int) -> int:
    """The transfer plan's bytes for n prompt tokens on the served model's layout (fp32 KV on
    CPU; no MTP layers, which a server loads only for speculative decoding)."""
    from engine.config import ModelConfig
    from engine.kv_layout import build_layout
    from engine.kv_transfer.plan import make_plan

    cfg = ModelConfig.from_model_dir(model_dir)
    return make_plan(build_layout(cfg, "auto", "fp32", 16, num_mtp_layers=0), n).nbytes


# ---- faults --------------------------------------------------------------------------------
def _leg1(pre: Server, prompt: list[int]) -> dict:
    status, body = _post(pre.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                       "temperature": 0,
                                                       "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200 and body["kv_transfer_params"]["do_remote_prefill"], body
    return body["kv_transfer_params"]


def test_unread_blocks_are_freed_when_the_lease_expires(pd):
    _, pre, dec, _ = pd
    expired = _kv(pre)["expired"]
    _leg1(pre, list(range(1, 30)))  # a decode that never comes
    assert _settles(pre, leases=1)["held_blocks"] > 0
    _settles(pre, timeout=15, leases=0, held_blocks=0, kv_blocks_used=0, expired=expired + 1)


def test_a_corrupt_block_fails_the_request_before_its_first_token(pd):
    _, pre, dec, _ = pd
    prompt = list(range(1, 30))
    before = _kv(dec)["digest_failures"]
    params = _leg1(pre, prompt)
    params["block_digests"][0][0] ^= 1 << 7  # what a bit flipped in transit looks like to the decode
    status, body = _post(dec.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                       "kv_transfer_params": params})
    assert status == 502 and "digest" in body["error"]["message"], body
    _settles(dec, digest_failures=before + 1)
    _holds_nothing(pre, dec)  # the decode's give-up notification released the prefill's lease at once


def test_params_that_do_not_match_the_prompt_are_refused(pd):
    _, pre, dec, _ = pd
    params = _leg1(pre, list(range(1, 30)))
    status, body = _post(dec.url + "/v1/completions", {"model": "tiny", "prompt": list(range(2, 31)),
                                                       "max_tokens": 4, "kv_transfer_params": params})
    assert status == 400 and "remote_prompt_hash" in body["error"]["message"], body
    _holds_nothing(dec)
    _settles(pre, timeout=15, leases=0, kv_blocks_used=0)  # the lease ran out


def test_an_unreachable_prefill_fails_the_request_cleanly(pd):
    _, pre, dec, _ = pd
    prompt = list(range(1, 30))
    params = dict(_leg1(pre, prompt), remote_engine_id="ringserve-gone", remote_port=free_port())
    status, body = _post(dec.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                       "kv_transfer_params": params})
    assert status == 503 and "KV transfer from prefill ringserve-gone failed" in body["error"]["message"], body
    _holds_nothing(dec)
    _settles(pre, timeout=15, leases=0, kv_blocks_used=0)


def test_a_dead_prefill_fails_the_decode_cleanly_and_the_proxy_says_why(pd):
    """Last: kills the prefill server between the two legs."""
    proxy, pre, dec, _ = pd
    prompt = list(range(1, 30))
    params = _leg1(pre, prompt)
    os.killpg(pre.proc.pid, signal.SIGKILL)
    pre.proc.wait(10)
    status, body = _post(dec.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                       "kv_transfer_params": params})
    assert status == 503 and "KV transfer from prefill" in body["error"]["message"], body
    _holds_nothing(dec)
    with pytest.raises(openai.APIStatusError) as err:
        _client(proxy.url).completions.create(model="tiny", prompt=prompt, **GREEDY)
    assert err.value.status_code == 503 and "no prefill server is up" in str(err.value)
