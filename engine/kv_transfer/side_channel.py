"""The KV side channel: how a decode gets a prefill's transport metadata, and the prefill the decode's.

A transport's metadata is what reaches its registered memory (NIXL: UCX addresses and the keys of
its registered memory, enough to READ that memory). NIXL's own metadata listener answers anyone,
on every interface; ringserve leaves it off and serves the metadata itself from one ZeroMQ ROUTER bound to the prefill's
advertised address and keyed with the cluster secret (CURVE, ipc/cluster_auth.py): only a
holder of the key gets an answer, and a stranger's bytes never reach the decoder. Without a key
the server refuses to bind it off loopback (unless --insecure-cluster; server/pd.py).

One round trip: reader → server `MetadataRequest{name, metadata}`; the server loads the reader's
metadata (so that it can answer the reader's Hello notification, peer_transport.py) and replies
`MetadataReply{name, metadata}` with its own. What arrives is capped in size (by ZeroMQ, before
allocation, and again here) and decoded into exactly these types; anything else is dropped and
counted (ipc/channel_guard.py). Driven by polling from the engine loop's thread, like the
rest of the transport: nothing here blocks.
"""
from __future__ import annotations

from typing import Annotated, Protocol

import msgspec
import zmq
from msgspec import Meta, Struct

from ipc.kv_transfer_params import EngineId
from ipc import cluster_auth
from ipc.channel_guard import DropLog, HandshakeMonitor, monitor_socket

MAX_METADATA_BYTES = 16 << 20
_MAX_MESSAGE_BYTES = MAX_METADATA_BYTES + 1024
_PER_SERVE = 16  # requests answered per serve() call (the engine loop calls it every step)
Metadata = Annotated[bytes, Meta(min_length=1, max_length=MAX_METADATA_BYTES)]


class MetadataRequest(Struct, frozen=True, array_like=True, tag=1):
    name: EngineId
    metadata: Metadata


class MetadataReply(Struct, frozen=True, array_like=True, tag=2):
    name: EngineId
    metadata: Metadata


_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE_REQUEST = msgspec.msgpack.Decoder(MetadataRequest).decode
_DECODE_REPLY = msgspec.msgpack.Decoder(MetadataReply).decode


class SideChannelError(RuntimeError):
    pass


class MetadataBook(Protocol):
    """The transport's table of peers' metadata (peer_transport.PeerTransport)."""

    def own_metadata(self) -> bytes: ...

    def has_remote(self, name: str) -> bool: ...

    def load_remote(self, metadata: bytes) -> str: ...

    def remove_remote(self, name: str) -> None: ...


class SideChannelServer:
    """The prefill's end: answers metadata requests when `serve()` is called."""

    def __init__(self, ctx: zmq.Context, book: MetadataBook, name: str, host: str, port: int,
                 auth: cluster_auth.ClusterAuth | None = None):
        self.book, self.name, self.host, self.port = book, name, host, port
        auth = auth or cluster_auth.current()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        self.zap = auth.secure_server(self.sock, cluster_auth.KV_SIDE_CHANNEL)
        self.monitor = HandshakeMonitor(self.sock, cluster_auth.KV_SIDE_CHANNEL)
        self.drops = DropLog(cluster_auth.KV_SIDE_CHANNEL)
        try:
            self.sock.bind(cluster_auth.tcp_endpoint(self.sock, host, port))
        except (zmq.ZMQError, OSError) as exc:
            self.close()
            raise SideChannelError(f"cannot listen for KV readers on {host}:{port}: {exc}") from None

    def serve(self) -> list[str]:
        """Answer the requests waiting now; returns the readers whose metadata was loaded."""
        self.monitor.poll()
        loaded = []
        for _ in range(_PER_SERVE):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            name = self._answer(frames)
            if name is not None:
                loaded.append(name)
        return loaded

    def _answer(self, frames: list[bytes]) -> str | None:
        if len(frames) != 2:
            self.drops.drop(frames[0], "frames", f"{len(frames) - 1} body frames, 1 expected")
            return None
        peer, raw = frames
        try:
            req = _DECODE_REQUEST(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.drops.drop(peer, "undecodable", str(exc))
            return None
        if not self.book.has_remote(req.name):
            try:
                loaded = self.book.load_remote(req.metadata)
            except Exception as exc:  # the transport refuses metadata it cannot parse
                self.drops.drop(peer, "invalid_metadata", f"{type(exc).__name__}: {exc}")
                return None
            if loaded != req.name:
                self.book.remove_remote(loaded)
                self.drops.drop(peer, "invalid_metadata", f"metadata of {loaded!r} sent as {req.name!r}")
                return None
        reply = MetadataReply(self.name, self.book.own_metadata())
        try:
            self.sock.send_multipart([peer, _ENCODE(reply)], zmq.NOBLOCK)
        except zmq.ZMQError:  # the reader went away meanwhile; it retries with a new request
            return None
        return req.name

    def close(self) -> None:
        self.monitor.close()
        self.sock.close(linger=0)
        if self.zap is not None:
            self.zap.stop()


class MetadataFetch:
    """The reader's end: one request to one server; `poll()` until it returns the metadata."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, name: str, metadata: bytes,
                 auth: cluster_auth.ClusterAuth | None = None):
        self.where = f"{host}:{port}"
        auth = auth or cluster_auth.current()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        auth.secure_client(self.sock, cluster_auth.KV_SIDE_CHANNEL)
        self.refusals = monitor_socket(self.sock, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                       | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.sock.connect(cluster_auth.tcp_endpoint(self.sock, host, port))
        self.sock.send(_ENCODE(MetadataRequest(name, metadata)), zmq.NOBLOCK)  # queued until connected

    def poll(self) -> MetadataReply | None:
        """The server's reply once it came; SideChannelError if the server refused the handshake."""
        if self.refusals.poll(0):
            raise SideChannelError(f"the KV side channel at {self.where} refused the handshake: the cluster keys "
                                   f"differ, or only one side has one")
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            if len(frames) == 1:
                try:
                    return _DECODE_REPLY(frames[0])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass
        return None

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.refusals.close(linger=0)
        self.sock.close(linger=0)
