"""Connecting to a KV server, reader side: the server's metadata over the side channel, then
Hello until a HelloReply comes back, then the geometry checked (peer_transport.py has the
server's side). Transport-independent: it drives the transport's primitives."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from . import protocol as wire
from .regions import check_geometry
from .side_channel import MetadataFetch, SideChannelError
from .transport import IncompatiblePeer, PeerUnavailable, TransportError

if TYPE_CHECKING:
    from .peer_transport import PeerTransport

_HANDSHAKE_RESEND_S = 0.5


@dataclass
class Peer:
    """A server we READ from: its geometry and the data plane's state for it (`remote`)."""

    name: str
    host: str
    port: int
    geometry: dict[str, wire.RegionGeometry]
    remote: Any
    transfers: set = field(default_factory=set)


class Handshake:
    """A connection in progress: `poll()` → 'pending' | 'done', or raises TransportError.
    Stages: 'metadata' → 'hello' → 'done' | 'failed'."""

    def __init__(self, transport: "PeerTransport", peer: str, host: str, port: int, expected: str, timeout_s: float):
        self.t, self.peer, self.host, self.port, self.expected = transport, peer, host, port, expected
        self.nonce = secrets.randbits(63)
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.stage = "metadata"
        self.error: TransportError | None = None
        self._last_send = 0.0
        self._reply: wire.HelloReply | None = None
        transport._forget_remote(peer)  # stale metadata under this name would block loading the new
        # One request, queued until ZeroMQ connects (it retries in the background until the deadline).
        self._fetch: MetadataFetch | None = None
        self._unreachable: str | None = None  # raised by the first poll (never from here)
        try:
            self._fetch = MetadataFetch(transport._zmq, host, port, transport.name, transport.own_metadata())
        except (OSError, zmq.ZMQError) as exc:
            self._unreachable = f"connect to {peer} at {host}:{port}: {exc}"

    @classmethod
    def connected(cls, transport: "PeerTransport", peer: str) -> "Handshake":
        hs = cls.__new__(cls)
        hs.t, hs.peer, hs.stage, hs.error, hs._fetch = transport, peer, "done", None, None
        return hs

    def poll(self) -> str:
        if self.stage == "done":
            return "done"
        if self.stage == "failed":
            raise self.error
        try:
            self._advance()
        except TransportError as exc:
            self.fail(exc)
        except Exception as exc:  # the data plane's errors while loading metadata or notifying
            self.fail(PeerUnavailable(f"connect to {self.peer} at {self.host}:{self.port}: "
                                      f"{type(exc).__name__}: {exc}"))
        if self.stage == "failed":
            raise self.error
        return "pending" if self.stage != "done" else "done"

    def on_reply(self, reply: wire.HelloReply) -> None:
        """The transport received a HelloReply from our peer."""
        if reply.nonce == self.nonce and self.stage == "hello":
            self._reply = reply

    def fail(self, error: TransportError) -> None:
        self.stage, self.error = "failed", error
        self._close_fetch()
        self.t._connecting.pop(self.peer, None)
        self.t._forget_remote(self.peer)

    def _advance(self) -> None:
        now = time.monotonic()
        if self.stage == "metadata":
            if self._unreachable is not None:
                raise PeerUnavailable(self._unreachable)
            try:
                reply = self._fetch.poll()
            except SideChannelError as exc:
                raise PeerUnavailable(f"connect to {self.peer}: {exc}") from None
            if reply is not None:
                self._load_metadata(reply)
                self.stage = "hello"
                self._hello()
        if self.stage == "hello":
            self.t.pump()
            if self._reply is not None:
                self._finish(self._reply)
                return
            if now - self._last_send > _HANDSHAKE_RESEND_S:
                self._hello()
        if self.stage != "done" and now > self.deadline:
            what = "metadata" if self.stage == "metadata" else "handshake reply"
            raise PeerUnavailable(f"no {what} from {self.peer} at {self.host}:{self.port} within "
                                  f"{self.deadline - self.started:.1f} s (wrong name or port, or not running)")

    def _load_metadata(self, reply) -> None:
        """The server's metadata came: load it under the name the params gave us, or fail."""
        if reply.name != self.peer:
            raise PeerUnavailable(f"{self.host}:{self.port} is KV server {reply.name!r}, not {self.peer!r}")
        loaded = self.t.load_remote(reply.metadata)
        if loaded != self.peer:
            self.t.remove_remote(loaded)
            raise PeerUnavailable(f"{self.host}:{self.port} sent the metadata of {loaded!r}, not {self.peer!r}")
        self._close_fetch()

    def _close_fetch(self) -> None:
        if self._fetch is not None:
            self._fetch.close()
            self._fetch = None

    def _hello(self) -> None:
        self._last_send = time.monotonic()
        self.t._send(self.peer, wire.encode_handshake(wire.Hello(wire.HANDSHAKE_VERSION, self.expected, self.nonce)))

    def _finish(self, reply: wire.HelloReply) -> None:
        if not reply.ok:
            raise IncompatiblePeer(f"{self.peer} refused us: {reply.reason}")
        if reply.compat_hash != self.expected:
            raise IncompatiblePeer(f"{self.peer} compatibility hash {reply.compat_hash[:16]}… != "
                                   f"expected {self.expected[:16]}…")
        theirs = {g.name: g for g in reply.regions}
        check_geometry(self.peer, self.t._regions, theirs)
        ordered = {name: theirs[name] for name in self.t._regions}  # our order: indices line up
        mem = {g.mem_type for g in ordered.values()}
        if len(mem) != 1:
            raise IncompatiblePeer(f"{self.peer} mixes host and device regions")
        remote = self.t._connect_memory(self.peer, ordered, mem.pop())
        self.t._add_peer(Peer(self.peer, self.host, self.port, theirs, remote))
        self.stage = "done"
