"""Multi-node expert parallelism, two "nodes" on one machine: a head (`serve`, HTTP, rank 0) and a
headless node (`serve --headless`, rank 1) that joins it over the rpc port. Their group serves
what one process serves, shuts down as one, fails as one, and refuses what does not fit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from process_state import all_gone
from server_process import API_KEY, Node, Server, free_port, segments_of, workers

PROMPTS = ["hello world", "the quick brown fox", "a", "once upon a time there was", "1 2 3 4", "zebra"]
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def _group_flags(rpc_port: int, *extra: str, dp: int = 2) -> list[str]:
    """A group of `dp` ranks, half on the head and half on one headless node."""
    return ["--dp", str(dp), "--data-parallel-size-local", str(dp // 2), "--enable-expert-parallel",
            "--data-parallel-rpc-port", str(rpc_port), *extra]


def _completions(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def one(prompt: str) -> str:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")
        return out.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: the router spreads them over both nodes
        return list(pool.map(one, PROMPTS))


def _start_group(model_dir, *extra: str, dp: int = 2) -> tuple[Node, Server]:
    port = free_port(2)  # the rpc port and the rendezvous store on the next one
    node = Node(model_dir, *_group_flags(port, *extra, dp=dp), "--data-parallel-start-rank", str(dp // 2))
    try:
        head = Server(model_dir, *_group_flags(port, *extra, dp=dp))
    except BaseException:
        node.stop()
        raise
    return node, head


# Outputs compared across layouts: exact fp32 products (with bf16 operands, the default on an AMX
# CPU, a row's rounding depends on the GEMM path its batch size picks; kernels/cpu_precision.py).
EXACT = ("--cpu-matmul-precision", "fp32")


def test_two_nodes_serve_what_one_process_serves_and_stop_together(model_dir):
    """--data-parallel-size 4 --data-parallel-size-local 2 on the head, start rank 2 on the other."""
    reference = Server(model_dir, *EXACT)
    try:
        expected = _completions(reference.url)
    finally:
        assert reference.stop() == 0
    node, head = _start_group(model_dir, *EXACT, dp=4)  # ranks 0-1 on the head, 2-3 on the headless node
    try:
        node_workers = workers(node.proc.pid)
        assert len(workers(head.proc.pid)) == 2 and len(node_workers) == 2
        got = _completions(head.url)
        assert head.get("/health")[0] == 200
    finally:
        head_code = head.stop()  # SIGTERM to the head alone: it tells the node to stop its ranks
        node_code = node.wait(60)
    assert got == expected
    assert (head_code, node_code) == (0, 0), (head.output(), node.output())
    assert "Traceback" not in node.output() and "Traceback" not in head.output()
    assert all_gone(node_workers)
    assert not segments_of(head.proc.pid) and not segments_of(node.proc.pid)


def test_a_killed_rank_on_the_other_node_takes_the_group_down(model_dir):
    """kill -9 of the headless node's rank mid-stream: the node reports it and exits 1, the head's
    stream ends with the cause, the head exits 1 (supervisors restart both, a new generation)."""
    node, head = _start_group(model_dir)
    try:
        victim = workers(node.proc.pid)[0]
        # Pin the stream to rank 1 (round-robin by session is not guaranteed): ask both ranks.
        events: list[bytes] = []

        def stream(prompt: str) -> list[bytes]:
            req = urllib.request.Request(head.url + "/v1/completions", json.dumps(
                {"model": "tiny", "prompt": prompt, "max_tokens": 1000, "ignore_eos": True, "stream": True}).encode(),
                HEADERS)
            got = []
            with urllib.request.urlopen(req, timeout=90) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        got.append(line[6:].strip())
                        if len(got) == 2 and prompt == "b":
                            os.kill(victim, signal.SIGKILL)
            return got

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(stream, ["a", "b"]))
        head_code = head.proc.wait(timeout=60)
        node_code = node.wait(60)
    finally:
        head.stop()
        node.stop()
    assert (head_code, node_code) == (1, 1), (head.output(), node.output())
    for events in results:  # both streams fail: an expert-parallel group cannot continue without a rank
        error = json.loads(events[-2])["error"]
        assert events[-1] == b"[DONE]" and "rank 1" in error["message"], events[-3:]
    assert "rank 1 exited" in node.output()
    assert not segments_of(head.proc.pid) and not segments_of(node.proc.pid)


def test_a_node_with_other_flags_is_refused_and_a_missing_node_is_named(model_dir):
    port = free_port(2)  # the rpc port and the rendezvous store on the next one
    node = Node(model_dir, *_group_flags(port, "--max-num-seqs", "3"), "--data-parallel-start-rank", "1")
    cmd = [sys.executable, "-m", "server.cli", "serve", str(model_dir), "--port", str(free_port()),
           "--kv-cache-memory", "0.05", "--block-size", "16", "--threads-per-worker", "1",
           *_group_flags(port, "--rendezvous-timeout", "4")]  # the node, started first, is refused well before
    t0 = time.monotonic()
    head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = head.communicate(timeout=120)
    took = time.monotonic() - t0
    node_code = node.wait(60)
    node_log = node.output()
    node.stop()
    assert node_code == 2 and "refused" in node_log and "configuration differs" in node_log, node_log
    assert head.returncode == 2
    last = stderr.strip().splitlines()[-1]  # one line says what is missing
    assert "ranks [1]" in last and "4 s" in last, stderr[-2000:]
    assert took < 60, took
    assert not segments_of(head.pid) and not workers(head.pid)


@pytest.mark.parametrize("flags, message", [
    (["--headless"], "--data-parallel-start-rank"),
    (["--dp", "2", "--data-parallel-start-rank", "1"], "must be 0 on the head"),
])
def test_node_flags_are_checked_before_anything_starts(model_dir, flags, message):
    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", str(model_dir), *flags], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr
