"""KV transfer over NIXL between real processes: UCX tcp on loopback, host-memory pools.

The server (prefill side) is a child process (`kv_transfer_peer.serve`); the reader (decode
side) is this process, or a second child where its own threads and sockets are measured.
Children fork from a multiprocessing forkserver that preloads torch and NIXL. The server fills
its regions from a seed with `fill_regions`, which the test calls as well, so every byte check
is against an independent copy of what the server holds. Each test ends with no child left
(the forkserver and its resource tracker, shared by the module, excepted).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
import torch

pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed")

import kv_transfer_peer  # noqa: E402
from engine.kv_transfer import digest, protocol  # noqa: E402
from engine.kv_transfer.nixl_transport import NixlTransport, unique_name  # noqa: E402
from engine.kv_transfer.transport import IncompatiblePeer, PeerUnavailable, TransferFailed  # noqa: E402
from ipc.kv_transfer_params import GROUPS, KVTransferParams  # noqa: E402
from kv_transfer_peer import fill_regions  # noqa: E402
from pd_engines import UCX_ENV  # noqa: E402
from process_state import stop_process  # noqa: E402

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "engine.kv_transfer.nixl_transport", "kv_transfer_peer"])
SPEC = {  # three regions of different shapes and dtypes, like the c4 / idx4 / swa pools
    "c4": {"tensors": 3, "blocks": 24, "shape": [4, 96], "dtype": "uint8", "fill": "random"},
    "idx4": {"tensors": 2, "blocks": 24, "shape": [4, 17], "dtype": "float32", "fill": "random"},
    "swa": {"tensors": 2, "blocks": 12, "shape": [16, 24], "dtype": "bfloat16", "fill": "random"},
}


@pytest.fixture(autouse=True)
def ucx_env(monkeypatch):
    for k, v in UCX_ENV.items():
        monkeypatch.setenv(k, v)


def _descendants() -> dict[int, str]:
    """Live descendants of this process → command line, multiprocessing's helpers left out."""
    parent, cmd = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":
            parent[int(pid)], cmd[int(pid)] = int(ppid), line
    out = {}
    for pid in parent:
        p = parent[pid]
        while p in parent and p != os.getpid():
            p = parent[p]
        if p == os.getpid() and "forkserver" not in cmd[pid] and "resource_tracker" not in cmd[pid]:
            out[pid] = cmd[pid]
    return out


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = set(_descendants())
    yield
    left = {p: c for p, c in _descendants().items() if p not in before}
    assert not left, f"processes left behind: {left}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class Peer:
    """A child process running a kv_transfer_peer program, and its message pipe."""

    def __init__(self, target, *args):
        self.conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=target, args=(child, UCX_ENV, *args), daemon=True)
        self.proc.start()
        child.close()
        self.notifs: list = []

    def expect(self, kind: str, timeout: float = 60.0):
        end = time.monotonic() + timeout
        while self.conn.poll(max(0.0, end - time.monotonic())):
            try:
                got, payload = self.conn.recv()
            except EOFError:
                raise AssertionError(f"peer exited before sending {kind} (exit code {self.proc.exitcode})") from None
            if got == kind:
                return payload
            if got == "notif":
                self.notifs.append(payload)
        raise AssertionError(f"no {kind} from the peer within {timeout} s")

    def notification(self, timeout: float = 10.0):
        return self.notifs.pop(0) if self.notifs else self.expect("notif", timeout)

    def ask(self, kind: str, *cmd):
        self.conn.send(cmd)
        return self.expect(kind)

    def stop(self) -> None:
        try:
            self.conn.send(("exit",))
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Server(Peer):
    def __init__(self, spec: dict, seed: int = 0, identity: dict | None = None):
        self.name, self.port = unique_name("prefill"), _free_port()
        super().__init__(kv_transfer_peer.serve, self.name, self.port, spec, seed, identity or {})
        self.ready = self.expect("ready")

    def served(self) -> list[str]:
        return self.ask("state", "state")["served"]


def _reader(spec: dict, seed: int = 99, identity: dict | None = None):
    """A decode-side transport in this process with regions of its own (other block counts)."""
    mine = {k: dict(v, blocks=v["blocks"] - 4) for k, v in spec.items()}
    regions = fill_regions(mine, seed)
    t = NixlTransport(unique_name("decode"), None, identity=identity or {})
    t.register(regions)
    return t, regions


def test_read_chosen_blocks_of_several_regions_byte_exact():
    with Server(SPEC) as srv:
        t, mine = _reader(SPEC)
        try:
            before = {k: [_bytes(x).clone() for x in v] for k, v in mine.items()}
            theirs = fill_regions(SPEC, 0)
            t.connect(srv.name, "127.0.0.1", srv.port)
            remote, local = [3, 17, 4, 23], [5, 1, 19, 2]
            sw_remote, sw_local = [11, 0, 6], [0, 7, 3]
            tr = t.read_many(srv.name, [("c4", remote, local), ("idx4", remote, local), ("swa", sw_remote, sw_local)],
                             notify=b"req-7:done")
            tr.wait(10)
            assert tr.poll() == "done" and tr.nbytes == sum(
                len(ids) * SPEC[r]["tensors"] * _bytes(theirs[r][0][0]).numel()
                for r, ids in (("c4", remote), ("idx4", remote), ("swa", sw_remote)))
            for name, (rids, lids) in {"c4": (remote, local), "idx4": (remote, local),
                                       "swa": (sw_remote, sw_local)}.items():
                for got, ref, old in zip(mine[name], theirs[name], before[name]):
                    assert torch.equal(_bytes(got[lids]), _bytes(ref[rids])), name
                    untouched = [b for b in range(got.shape[0]) if b not in lids]
                    assert torch.equal(_bytes(got[untouched]), old[untouched]), name
            assert srv.notification() == (t.name, b"req-7:done")
        finally:
            t.close()


def test_notifications_both_ways_and_goodbye():
    with Server(SPEC) as srv:
        t, _ = _reader(SPEC)
        try:
            t.connect(srv.name, "127.0.0.1", srv.port)
            renew = protocol.encode_notification(protocol.KVRenew(["req-1", "req-2"]))
            t.send_notification(srv.name, renew)
            peer, data = srv.notification()
            assert peer == t.name
            assert protocol.decode_notification(data) == protocol.KVRenew(["req-1", "req-2"])
            srv.ask("sent", "notify", t.name, b"from-prefill")
            end, received = time.monotonic() + 5, []
            while not received and time.monotonic() < end:
                received = t.notifications()
                time.sleep(0.005)
            assert received == [(srv.name, b"from-prefill")]
            assert srv.served() == [t.name]
        finally:
            t.close()
        # The reader's Bye makes the server drop its metadata and forget it.
        end = time.monotonic() + 5
        while srv.served() and time.monotonic() < end:
            time.sleep(0.05)
        assert srv.served() == []


def test_incompatible_peer_is_refused():
    with Server(SPEC, identity={"model": "v4-flash", "rev": "a"}) as srv:
        server_hash = srv.ready["hash"]
        other, _ = _reader(SPEC, identity={"model": "v4-flash", "rev": "b"})
        try:  # a different identity: the server refuses the handshake
            with pytest.raises(IncompatiblePeer, match="refused us: compatibility hash"):
                other.connect(srv.name, "127.0.0.1", srv.port, timeout_s=10)
            assert other.state()["peers"] == []
        finally:
            other.close()
        # Same identity and the server's hash as expected, but another geometry (block bytes):
        # the reader's own check of the reply refuses it.
        wrong = {**SPEC, "c4": {**SPEC["c4"], "shape": [4, 95]}}
        liar, _ = _reader(wrong, identity={"model": "v4-flash", "rev": "a"})
        try:
            with pytest.raises(IncompatiblePeer, match="region c4"):
                liar.connect(srv.name, "127.0.0.1", srv.port, expected_hash=server_hash, timeout_s=10)
        finally:
            liar.close()
        assert srv.served() in ([], [liar.name])


def test_unreachable_peer_times_out_cleanly():
    t, _ = _reader(SPEC)
    try:
        start = time.monotonic()
        with pytest.raises(PeerUnavailable, match="no metadata"):
            t.connect("nobody", "127.0.0.1", _free_port(), timeout_s=1.0)
        assert time.monotonic() - start < 8.0  # the 1 s timeout, with room for a loaded machine
        with pytest.raises(TransferFailed, match="not connected"):
            t.read("nobody", "c4", [1], [1]).poll()
    finally:
        t.close()


def test_flipped_bit_after_digest_is_caught():
    with Server(SPEC) as srv:
        t, mine = _reader(SPEC)
        try:
            t.connect(srv.name, "127.0.0.1", srv.port)
            remote, local = [2, 5, 7, 20], [1, 2, 3, 4]
            digests = srv.ask("digests", "digests", ["c4", "idx4"], remote)
            srv.ask("flipped", "flip", "c4", 1, 5, 133, 3)  # after hand-off
            t.read(srv.name, ["c4", "idx4"], remote, local).wait(10)
            group = mine["c4"] + mine["idx4"]
            with pytest.raises(digest.DigestMismatch) as err:
                digest.verify(group, local, digests)
            assert err.value.positions == [1]  # exactly the flipped block
            # The bytes that did cross are the flipped ones: a digest taken now matches them.
            assert digest.mismatches(group, local, srv.ask("digests", "digests", ["c4", "idx4"], remote)) == []
        finally:
            t.close()


BIG = {"big": {"tensors": 1, "blocks": 128, "shape": [1 << 20], "dtype": "uint8", "fill": 165}}


def test_server_killed_mid_transfer_fails_within_bound():
    with Server(BIG) as srv:
        t = NixlTransport(unique_name("decode"), None)
        dst = torch.zeros(BIG["big"]["blocks"], 1 << 20, dtype=torch.uint8)
        t.register({"big": dst})
        try:
            t.connect(srv.name, "127.0.0.1", srv.port)
            ids = list(range(1, BIG["big"]["blocks"]))
            tr = t.read(srv.name, "big", ids, ids)
            assert tr.poll() == "pending"  # just posted: 127 MiB over tcp cannot have landed yet
            os.kill(srv.proc.pid, signal.SIGKILL)  # at once (a quiet machine moves it in tens of ms)
            killed = time.monotonic()
            states = []
            with pytest.raises(TransferFailed) as err:
                while time.monotonic() - killed < 10:
                    states.append(tr.poll())
                    time.sleep(0.001)
            detected = time.monotonic() - killed
            assert detected < 2.0, f"disconnect seen after {detected:.2f} s"
            assert "done" not in states and tr.state == "failed"
            assert "Disconnect" in type(err.value.cause).__name__, err.value
            landed = int((dst[1:] == 165).sum())
            assert landed < len(ids) << 20  # partial: never reported as done
            assert t.state()["peers"] == [] and t.state()["pending_transfers"] == 0
            with pytest.raises(TransferFailed, match="not connected"):
                t.read(srv.name, "big", [1], [1]).poll()
            print(f"disconnect detected {detected * 1e3:.0f} ms after SIGKILL; {landed / 2**20:.1f} MiB had landed")
        finally:
            t.close()


def test_stalled_server_times_out_and_is_dropped():
    with Server(SPEC) as srv:
        t, _ = _reader(SPEC)
        try:
            t.connect(srv.name, "127.0.0.1", srv.port)
            stop_process(srv.proc.pid)  # alive but silent: no disconnect ever comes
            tr = t.read(srv.name, "c4", [1, 2, 3], [1, 2, 3], timeout_s=0.5)
            start = time.monotonic()
            with pytest.raises(TransferFailed, match="timed out"):
                tr.wait(10)
            assert 0.4 < time.monotonic() - start < 6.0  # the 0.5 s read timeout, not wait()'s 10 s
            assert t.state()["peers"] == []  # disconnected: nothing more of it can land
        finally:
            t.close()
            os.kill(srv.proc.pid, signal.SIGCONT)


def test_reader_process_returns_to_baseline_after_close():
    small = {"c4": SPEC["c4"]}
    with Server(small) as srv:
        with Peer(kv_transfer_peer.leakcheck, unique_name("decode"), srv.name, srv.port, small, 0) as reader:
            r = reader.expect("result")
        assert r["exact"]
        empty, registered, after = r["md"]
        assert registered > empty and after == empty  # the agent's metadata lists no memory
        assert not r["remote_left"] and r["prep_refused"]
        assert r["during"]["threads"] > r["before"]["threads"] and r["during"]["sockets"] > 0
        assert r["after"] == r["before"], r
        end = time.monotonic() + 5  # the server forgot the reader too (its Bye)
        while srv.served() and time.monotonic() < end:
            time.sleep(0.05)
        assert srv.served() == []


def test_pd_handoff_between_two_kv_caches():
    """The whole pull protocol on real ringserve pools (two agents in this process, over tcp):
    prefill hands off a 40-token sequence under a lease with digests in signed params; decode
    gates the params on its own prompt, allocates, READs both groups, verifies, says done."""
    from engine.kv_cache import KVCache
    from engine.kv_layout import build_layout
    from engine.kv_transfer import kv_pools
    from engine.kv_transfer.lease import LeaseTable
    from engine.v4.checkpoint import preset_config

    cfg, n, bs, key = preset_config("tiny"), 40, 16, b"pd-secret"
    prompt = list(range(7, 7 + n))
    layout = build_layout(cfg, "auto", "fp32", bs)
    keep = layout.sliding_keep(8)
    ident = kv_pools.compat_identity(cfg, layout, model_id="tiny@0", compute_dtype="fp32")
    p_cache, d_cache = KVCache(cfg, layout, 12, 10, torch.float32), KVCache(cfg, layout, 9, 8, torch.float32)
    g = torch.Generator().manual_seed(3)
    for t in kv_pools.pool_regions(p_cache).values():
        for x in t:
            x.copy_(torch.randn(x.shape, generator=g))
    prefill = NixlTransport(unique_name("prefill"), _free_port(), identity=ident)
    decode = NixlTransport(unique_name("decode"), None, identity=ident)
    try:
        prefill.register(kv_pools.pool_regions(p_cache))
        decode.register(kv_pools.pool_regions(d_cache))
        # prefill: compute (here: allocate) 40 tokens in chunks, hold the blocks, hand off
        seq = p_cache.new_sequence()
        for start in range(0, n, 16):
            assert p_cache.allocate(seq, start, min(start + 16, n))
        hand = kv_pools.handoff_blocks(seq.table, n, bs, keep)
        leases = LeaseTable()
        leases.hold("req-1", seq, ttl_s=30.0)
        params = protocol.sign(KVTransferParams(
            do_remote_prefill=True, remote_engine_id=prefill.name, remote_host="127.0.0.1",
            remote_port=prefill.listen_port, remote_request_id="req-1",
            remote_blocks_expiry_time=time.time() + leases.remaining("req-1"), remote_num_tokens=n,
            remote_sliding_first=hand["sliding"][0], remote_block_ids=[hand[gr][1] for gr in GROUPS],
            block_digests=[digest.block_digests(kv_pools.group_tensors(p_cache, gr), hand[gr][1])
                           for gr in GROUPS],
            compat_hash=prefill.layout_digest(), remote_first_token=5,
            remote_prompt_hash=protocol.prompt_hash(prompt)), key)
        body = json.dumps({"kv_transfer_params": protocol.params_to_json(params)})

        # decode: validate before allocating anything, then allocate from its own prompt length
        got = protocol.parse_params(json.loads(body)["kv_transfer_params"])
        protocol.verify(got, key)
        ranges = protocol.expected_blocks(len(prompt), bs, keep)
        protocol.check_for_decode(got, prompt_token_ids=prompt, blocks=ranges, compat_hash=decode.layout_digest(),
                                  now=time.time())
        dseq = d_cache.new_sequence()
        assert d_cache.manager.allocate(dseq.table, n, n)
        local = {"full": dseq.table.full[slice(*ranges["full"])],
                 "sliding": [dseq.table.sliding_id(i) for i in range(*ranges["sliding"])]}
        hs = decode.start_connect(got.remote_engine_id, got.remote_host, got.remote_port, got.compat_hash)
        while hs.poll() == "pending":
            prefill.pump()  # the prefill's engine loop
            time.sleep(0.002)
        groups = kv_pools.group_regions(layout)
        items = [(r, got.group_blocks(gr)[0], local[gr]) for gr in GROUPS for r in groups[gr]]
        done = protocol.encode_notification(protocol.KVDone([got.remote_request_id]))
        decode.read_many(got.remote_engine_id, items, notify=done).wait(10)
        for gr in GROUPS:
            digest.verify(kv_pools.group_tensors(d_cache, gr), local[gr], got.group_blocks(gr)[1])
            for pt, dt in zip(kv_pools.group_tensors(p_cache, gr), kv_pools.group_tensors(d_cache, gr)):
                assert torch.equal(dt[local[gr]], pt[hand[gr][1]])

        # prefill: the READ's notification ends the lease; the blocks go back to the pool
        end, msgs = time.monotonic() + 5, []
        while not msgs and time.monotonic() < end:
            msgs = prefill.notifications()
        assert [protocol.decode_notification(m) for _, m in msgs] == [protocol.KVDone(["req-1"])]
        p_cache.free(leases.release("req-1"))
        assert p_cache.manager.full.num_used == 0 and len(leases) == 0
    finally:
        decode.close()
        prefill.close()


def _pair(n_server: int = 16, n_reader: int = 8):
    """A server and a reader transport in this process (two agents over tcp), connected."""
    server = NixlTransport(unique_name("prefill"), _free_port())
    reader = NixlTransport(unique_name("decode"), None)
    x = torch.arange(n_server * 64, dtype=torch.int32).view(n_server, 64)
    y = torch.zeros(n_reader, 64, dtype=torch.int32)
    server.register({"r": x})
    reader.register({"r": y})
    hs = reader.start_connect(server.name, "127.0.0.1", server.listen_port)
    while hs.poll() == "pending":
        server.pump()
        time.sleep(0.002)
    return server, reader, x, y


def test_pruning_an_idle_reader_keeps_its_reads_working():
    server, reader, x, y = _pair()
    try:
        assert server.served() == [reader.name]
        assert server.prune(idle_s=3600) == []
        assert server.prune(idle_s=0.0) == [reader.name] and server.served() == []
        assert not server._agent.check_remote_metadata(reader.name)  # metadata and endpoint gone
        reader.read(server.name, "r", [5, 6], [2, 3]).wait(5)  # one-sided: still fine
        assert torch.equal(y[2:4], x[5:7])
        with pytest.raises(PeerUnavailable):
            server.send_notification(reader.name, b"x")
    finally:
        reader.close()
        server.close()


def test_bad_arguments_are_refused_before_anything_moves():
    server, reader, _, y = _pair()
    try:
        with pytest.raises(ValueError, match=r"in \[0, 8\)"):
            reader.read(server.name, "r", [1], [8])
        with pytest.raises(ValueError, match=r"in \[0, 16\)"):
            reader.read(server.name, "r", [16], [1])
        with pytest.raises(ValueError, match="written twice"):
            reader.read(server.name, "r", [1, 2], [3, 3])
        with pytest.raises(KeyError):
            reader.read(server.name, "nope", [1], [1])
        with pytest.raises(ValueError, match="reserved"):
            reader.send_notification(server.name, protocol.HANDSHAKE_MAGIC + b"x")
        with pytest.raises(Exception, match="already registered"):
            reader.register({"r2": y})
        assert reader.read(server.name, "r", [], []).poll() == "done"
        assert reader.state()["pending_transfers"] == 0
        with pytest.raises(Exception, match="cannot start NIXL agent"):
            NixlTransport(unique_name("again"), server.listen_port)  # the server holds the port
    finally:
        reader.close()
        server.close()
