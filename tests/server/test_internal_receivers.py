"""The other two internal receive loops against hostile input over real ZeroMQ sockets: the
rendezvous store (engine/distributed/rendezvous_store.py) and the KV side channel
(engine/kv_transfer/side_channel.py). Whatever arrives — wrong frame counts, random bytes,
requests over the caps, metadata NIXL refuses — is dropped and counted, and the loop goes on
answering its real clients. With a cluster key, a client without it gets nothing."""
from __future__ import annotations

import os
import time
from datetime import timedelta

import msgspec
import pytest
import zmq

from engine.distributed.group import pick_free_port
from engine.distributed.rendezvous_store import MAX_KEY_CHARS, ClusterStore, StoreServer, StoreTimeout
from engine.kv_transfer.side_channel import MetadataFetch, MetadataRequest, SideChannelError, SideChannelServer
from ipc.channel_guard import DROPPED
from ipc.cluster_auth import KV_SIDE_CHANNEL, RENDEZVOUS_STORE, ClusterAuth, generate_key

NO_KEY = ClusterAuth(None)


def _dropped(channel: str, reason: str) -> float:
    return DROPPED.labels(channel, reason)._value.get()


def _raw_dealer(ctx: zmq.Context, port: int, auth: ClusterAuth = NO_KEY) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.secure_client(sock, RENDEZVOUS_STORE)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _until(condition, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def test_the_store_drops_what_it_cannot_use_and_keeps_serving():
    port = pick_free_port()
    server = StoreServer("127.0.0.1", port, auth=NO_KEY)
    client = ClusterStore("127.0.0.1", port, timedelta(seconds=5), auth=NO_KEY)
    ctx = zmq.Context()
    try:
        client.set("a", b"1")
        before = {r: _dropped(RENDEZVOUS_STORE, r) for r in ("frames", "undecodable")}
        stranger = _raw_dealer(ctx, port)
        stranger.send_multipart([b"a", b"b"])
        stranger.send(os.urandom(4096))
        stranger.send(msgspec.msgpack.encode([1, 1, "k" * (MAX_KEY_CHARS + 1), b"v"]))  # a key over the cap
        stranger.send(msgspec.msgpack.encode([9, 1]))  # no such request
        assert _until(lambda: _dropped(RENDEZVOUS_STORE, "undecodable") - before["undecodable"] >= 3)
        assert _dropped(RENDEZVOUS_STORE, "frames") - before["frames"] == 1
        assert client.get("a") == b"1" and client.add("n", 2) == 2 and client.num_keys() == 2
        with pytest.raises(StoreTimeout):
            client.wait(["never"], timedelta(seconds=0.2))
    finally:
        ctx.destroy(linger=0)
        client.close()
        server.stop()


def test_the_store_answers_only_holders_of_the_key():
    key, other = (ClusterAuth(bytes.fromhex(generate_key())) for _ in range(2))
    port = pick_free_port()
    server = StoreServer("127.0.0.1", port, auth=key)
    good = ClusterStore("127.0.0.1", port, timedelta(seconds=5), auth=key)
    try:
        good.set("secret", b"nccl bootstrap id")
        for auth in (NO_KEY, other):
            stranger = ClusterStore("127.0.0.1", port, timedelta(seconds=0.5), auth=auth)
            try:
                with pytest.raises(StoreTimeout, match="no answer"):
                    stranger.get("secret")
                with pytest.raises(StoreTimeout):
                    stranger.set("secret", b"overwritten")
            finally:
                stranger.close()
        assert good.get("secret") == b"nccl bootstrap id"
    finally:
        good.close()
        server.stop()


class _Agent:
    """Stands in for a transport's metadata book: the side channel only loads and hands out metadata."""

    def __init__(self, name: str):
        self.name, self.loaded = name, {}

    def own_metadata(self) -> bytes:
        return b"metadata of " + self.name.encode()

    def has_remote(self, name: str) -> bool:
        return name in self.loaded

    def load_remote(self, metadata: bytes) -> str:
        if not metadata.startswith(b"metadata of "):
            raise RuntimeError("the transport could not parse the metadata")
        name = metadata[len(b"metadata of "):].decode()
        self.loaded[name] = metadata
        return name

    def remove_remote(self, name: str) -> None:
        self.loaded.pop(name, None)


def _fetch(ctx, port: int, reader: _Agent, auth: ClusterAuth, server: SideChannelServer, timeout: float = 3.0):
    fetch = MetadataFetch(ctx, "127.0.0.1", port, reader.name, reader.own_metadata(), auth=auth)
    try:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            server.serve()
            reply = fetch.poll()
            if reply is not None:
                return reply
            time.sleep(0.01)
        return None
    finally:
        fetch.close()


def test_the_side_channel_drops_bad_requests_and_serves_only_holders_of_the_key():
    key, other = (ClusterAuth(bytes.fromhex(generate_key())) for _ in range(2))
    ctx = zmq.Context()
    port = pick_free_port()
    agent = _Agent("prefill-1")
    server = SideChannelServer(ctx, agent, agent.name, "127.0.0.1", port, auth=key)
    try:
        before = {r: _dropped(KV_SIDE_CHANNEL, r) for r in ("frames", "undecodable", "invalid_metadata")}
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        key.secure_client(bad, KV_SIDE_CHANNEL)  # a key holder that misbehaves: its input is checked all the same
        bad.connect(f"tcp://127.0.0.1:{port}")
        bad.send_multipart([b"x", b"y"])
        bad.send(os.urandom(300))
        bad.send(msgspec.msgpack.encode(MetadataRequest("decode-9", b"not nixl metadata")))
        bad.send(msgspec.msgpack.encode(MetadataRequest("decode-9", b"metadata of someone-else")))
        assert _until(lambda: (server.serve(), _dropped(KV_SIDE_CHANNEL, "invalid_metadata"))[1]
                      - before["invalid_metadata"] >= 2)
        assert _dropped(KV_SIDE_CHANNEL, "frames") - before["frames"] == 1
        assert _dropped(KV_SIDE_CHANNEL, "undecodable") - before["undecodable"] == 1
        assert set(agent.loaded) == set()  # nothing it refused was kept
        reader = _Agent("decode-1")
        reply = _fetch(ctx, port, reader, key, server)
        assert reply is not None and reply.name == "prefill-1" and reply.metadata == b"metadata of prefill-1"
        assert set(agent.loaded) == {"decode-1"}
        for auth in (NO_KEY, other):
            with pytest.raises(SideChannelError, match="refused the handshake"):
                _fetch(ctx, port, _Agent("decode-2"), auth, server)
        assert set(agent.loaded) == {"decode-1"}
    finally:
        server.close()
        ctx.destroy(linger=0)


def test_the_drops_are_on_metrics_with_the_servers_model_name():
    from prometheus_client.parser import text_string_to_metric_families

    from ipc.channel_guard import DropLog
    from server.metrics import Metrics

    before = _dropped("node-channel", "frames")
    DropLog("node-channel").drop(b"peer", "frames", "3 frames")
    body, _ = Metrics("tiny").render()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    key = ("ringserve:internal_messages_dropped_total",
           (("channel", "node-channel"), ("model_name", "tiny"), ("reason", "frames")))
    assert samples[key] == before + 1
