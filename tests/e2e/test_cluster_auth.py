"""Issue 38 on a real two-"node" group on loopback (a head `serve` and a `serve --headless`):
hostile frames on the node port, strangers and wrong keys, the listeners' addresses, and a head
stopped in the middle of the rendezvous. Each finding as it was reported, now refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import zmq

from listeners import listening, port_free, process_tree
from server_process import API_KEY, Node, Server, free_port, segments_of, workers

PROMPTS = ["hello world", "the quick brown fox", "a", "once upon a time"]


def _flags(rpc_port: int, *extra: str) -> list[str]:
    return ["--dp", "2", "--data-parallel-size-local", "1", "--enable-expert-parallel", "--data-parallel-rpc-port",
            str(rpc_port), *extra]


def _group(model_dir, *extra: str) -> tuple[Node, Server, int]:
    port = free_port(2)  # the rpc port and the rendezvous store on the next one
    node = Node(model_dir, *_flags(port, *extra), "--data-parallel-start-rank", "1")
    try:
        head = Server(model_dir, *_flags(port, *extra))
    except BaseException:
        node.stop()
        raise
    return node, head, port


def _serves_both_ranks(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def one(prompt: str) -> str:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")
        return out.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: the router spreads them over both ranks
        return list(pool.map(one, PROMPTS))


def _metric(head: Server, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(head.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _send_from_another_process(endpoint: str, code: str) -> None:
    """Run a ZeroMQ sender in its own process (its memory is not the head's)."""
    subprocess.run([sys.executable, "-c", "import sys, zmq; s = zmq.Context().socket(zmq.DEALER); "
                    "s.setsockopt(zmq.LINGER, 3000); s.connect(sys.argv[1]); " + code + "; s.close()", endpoint],
                   check=True, timeout=60)


def test_hostile_frames_on_the_node_port_leave_the_group_serving(model_dir):
    """Findings 1 and 4 without a key (loopback): two frames, random bytes and a 256 MiB frame
    from a stranger. The head keeps every rank (heartbeats included: /health stays 200 past the
    liveness timeout, shortened to 2.5 s here), serves on both, does not grow, and counts what it dropped."""
    node, head, port = _group(model_dir, "--worker-liveness-timeout", "2.5")
    try:
        rss0 = _rss_mib(head.proc.pid)
        endpoint = f"tcp://127.0.0.1:{port}"
        ctx = zmq.Context()
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 1000)
        stranger.connect(endpoint)
        stranger.send_multipart([b"a", b"b"])
        stranger.send(os.urandom(4096))
        stranger.close()
        ctx.term()
        _send_from_another_process(endpoint, "s.send(bytes(256 << 20))")
        time.sleep(3.5)  # past the liveness timeout
        assert head.get("/health")[0] == 200, head.output()
        assert len(_serves_both_ranks(head.url)) == len(PROMPTS)
        assert _rss_mib(head.proc.pid) - rss0 < 100
        drops = {r: _metric(head, "ringserve:internal_messages_dropped_total", channel="node-channel", reason=r)
                 for r in ("frames", "oversize")}
        closed = _metric(head, "ringserve:internal_connections_closed_total", channel="node-channel")
    finally:
        head_code = head.stop()
        node_code = node.wait(60)
    assert (head_code, node_code) == (0, 0), (head.output(), node.output())
    assert drops["frames"] >= 1 and drops["oversize"] >= 1 and closed >= 1, (drops, closed)


def test_with_a_cluster_key_strangers_and_wrong_keys_are_refused_and_listeners_stay_where_told(model_dir, tmp_path):
    """Findings 2 and 3 with a key: the group forms and serves over CURVE; a node with another key,
    or with none, is refused at the handshake at once (one line, exit 2); a stranger with the
    group's public digest gets nothing through; every process of the group listens on 127.0.0.1
    only (the node port, the rendezvous store, gloo, HTTP)."""
    key, other = tmp_path / "cluster.key", tmp_path / "other.key"
    for path in (key, other):
        out = subprocess.run([sys.executable, "-m", "server.cli", "cluster-key", "--out", str(path)],
                             capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.strip() == path.read_text().strip() and oct(path.stat().st_mode & 0o777) == "0o600"
    node, head, port = _group(model_dir, "--cluster-key-file", str(key))
    try:
        assert "authenticated and encrypted with the cluster key" in head.output()
        refused0 = _metric(head, "ringserve:internal_connections_refused_total", channel="node-channel")
        intruders = [Node(model_dir, *_flags(port, *flags), "--data-parallel-start-rank", "1", log_name="intruder")
                     for flags in (("--cluster-key-file", str(other)), ())]
        codes = [n.wait(60) for n in intruders]
        logs = [n.output() for n in intruders]
        for n in intruders:
            n.stop()
        ctx = zmq.Context()
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(f"tcp://127.0.0.1:{port}")
        stranger.send(os.urandom(64))
        answered = stranger.poll(2000)
        ctx.destroy(linger=0)
        assert len(_serves_both_ranks(head.url)) == len(PROMPTS)
        refused = _metric(head, "ringserve:internal_connections_refused_total", channel="node-channel") - refused0
        addresses = {addr for addr, _, _ in listening(process_tree(head.proc.pid) + process_tree(node.proc.pid))}
        store_owner = {pid for _, p, pid in listening(process_tree(head.proc.pid)) if p == port + 1}
        head_workers = set(workers(head.proc.pid))
    finally:
        head_code = head.stop()
        node_code = node.wait(60)
    assert (head_code, node_code) == (0, 0), (head.output(), node.output())
    assert codes == [2, 2], logs
    for log in logs:
        assert "refused this node's handshake: the cluster keys differ" in log.strip().splitlines()[-1], log[-1500:]
    assert not answered and refused >= 3
    assert addresses == {"127.0.0.1"}, addresses
    assert store_owner and store_owner <= head_workers  # rank 0 hosts the store


def _head_in_rendezvous(model_dir, port: int) -> tuple[subprocess.Popen, int]:
    """A head whose node never comes: its rank 0 waits in the rendezvous, hosting the store."""
    cmd = [sys.executable, "-m", "server.cli", "serve", str(model_dir), "--port", str(free_port()),
           "--kv-cache-memory", "0.05", "--block-size", "16", "--threads-per-worker", "1",
           *_flags(port, "--rendezvous-timeout", "120")]
    head = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = workers(head.pid)
        if ranks and any(p == port + 1 for _, p, _ in listening(ranks)):
            return head, ranks[0]
        assert head.poll() is None, head.stderr.read()
        time.sleep(0.1)
    raise AssertionError("the head's rank 0 never hosted the rendezvous store")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_head_stopped_during_the_rendezvous_leaves_nothing_and_the_next_start_succeeds(model_dir):
    """Finding 3: stopping the head mid-rendezvous orphaned its rank 0, which held the store's port
    for the whole timeout, and the next start failed (EADDRINUSE). Now SIGTERM stops the start
    and its workers (exit 0); after SIGKILL, rank 0 sees its server gone and leaves at once; the
    ports are free and a group starts on them right away."""
    port = free_port(2)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        head, rank0 = _head_in_rendezvous(model_dir, port)
        os.kill(head.pid, sig)
        code = head.wait(30)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL), head.stderr.read()
        assert _gone(rank0, 10), f"rank 0 ({rank0}) outlived its head ({signal.Signals(sig).name})"
        assert port_free(port) and port_free(port + 1)
    node = Node(model_dir, *_flags(port), "--data-parallel-start-rank", "1")
    try:
        head = Server(model_dir, *_flags(port))
    except BaseException:
        node.stop()
        raise
    try:
        assert len(_serves_both_ranks(head.url)) == len(PROMPTS)
    finally:
        assert head.stop(timeout=180) == 0 and node.wait(180) == 0  # wide: a loaded 2-core machine
    assert not segments_of(head.proc.pid)
