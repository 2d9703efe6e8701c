"""The transfer protocol over any data plane: `PeerTransport` implements `KVTransport`
(transport.py) once, and a transport (NIXL: nixl_transport.py) supplies a dozen primitives.

What lives here, the same for every transport:
  * regions: checked and hashed with the caller's identity into the compatibility hash
    (regions.py);
  * connecting, reader side (handshake.py): the server's metadata over the KV side channel
    (side_channel.py, keyed with the cluster key), then `Hello{compat_hash, nonce}` as a
    notification until `HelloReply{ok, compat_hash, regions}` comes back, then the geometry
    checked against ours. A mismatch on either side is `IncompatiblePeer`;
  * the server side: answer the side channel and each Hello (`pump()`, from `notifications()`,
    every engine step), remember accepted readers, forget silent ones (`prune`);
  * READs as `Transfer`s (transfer.py): 'pending' until the data plane reports them done; a
    failure or a timeout is `TransferFailed`, and its peer is disconnected so nothing more can land;
  * notifications: handshake messages carry `protocol.HANDSHAKE_MAGIC` and are consumed here,
    `notifications()` returns only the application's.

The primitives (abstract below) are what differs between transports: the endpoint's metadata
(`own_metadata`, `has_remote`, `load_remote`, `remove_remote`), notifications (`_send`,
`_receive`), memory (`_register_memory`, `_connect_memory`, `_release_remote`), READs
(`_create_span_read`, `_start_read`, `_read_state`, `_release_read`) and `_close_backend`.
Not thread-safe: one thread (the engine loop) drives a transport.
"""
from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from . import protocol as wire
from .handshake import Handshake, Peer
from .regions import Region, build_regions, compat_hash, span_rows
from .side_channel import SideChannelError, SideChannelServer
from .transfer import Transfer
from .transport import KVTransport, PeerUnavailable, TransferFailed, TransportError

log = logging.getLogger("engine.kv_transfer.transport")
_PENDING_HELLO_S = 5.0  # how long a server waits for a reader's metadata before dropping its Hello


@dataclass
class _PendingHello:
    hello: wire.Hello
    since: float


# ---- the protocol ---------------------------------------------------------------------------
class PeerTransport(KVTransport):
    """Handshake, geometry, peers and transfer states over the subclass's data plane. The
    subclass starts its endpoint, then calls this __init__ (which may listen already)."""

    kind = "KV transport"  # the data plane's name in messages ("NIXL")

    def __init__(self, name: str, listen_port: int | None, identity: Mapping[str, Any] | None, listen_host: str):
        self.name, self.listen_port = name, listen_port
        self._live = True  # the data plane is up (False once _close_backend ran)
        self._zmq = zmq.Context()
        self._side: SideChannelServer | None = None
        if listen_port is not None:
            try:
                self.listen_at(listen_host)
            except TransportError as exc:
                self._zmq.destroy(linger=0)
                self._shut_backend()
                raise TransportError(f"cannot start {self.kind} agent {name!r} (listen port {listen_port}): {exc}") from None
        self.identity = dict(identity or {})
        self._regions: dict[str, Region] = {}
        self._peers: dict[str, Peer] = {}  # servers we READ from
        self._served: dict[str, float] = {}  # readers we accepted → last time we heard from them
        self._connecting: dict[str, Handshake] = {}
        self._pending_hellos: dict[str, _PendingHello] = {}
        self._fetched: dict[str, float] = {}  # readers whose metadata the side channel loaded → when
        self._inbox: list[tuple[str, bytes]] = []
        self._pending: set[Transfer] = set()
        self._digest: str | None = None
        self.closed = False

    # -- primitives: the data plane ----------------------------------------------------------
    @abstractmethod
    def own_metadata(self) -> bytes:
        """What a peer needs to reach this endpoint (sent over the side channel)."""

    @abstractmethod
    def has_remote(self, peer: str) -> bool:
        """Whether a peer's metadata is loaded."""

    @abstractmethod
    def load_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; the name it carries."""

    @abstractmethod
    def remove_remote(self, peer: str) -> None:
        """Drop a peer's metadata (and any connection to it)."""

    @abstractmethod
    def _send(self, peer: str, data: bytes) -> None:
        """Send a notification (raises when the peer cannot be reached)."""

    @abstractmethod
    def _receive(self) -> Mapping[str, Sequence[bytes]]:
        """Notifications received since the last call, by peer."""

    @abstractmethod
    def _register_memory(self, regions: dict[str, Region], mem_type: str) -> None:
        """Register the regions' tensors for remote READs."""

    @abstractmethod
    def _connect_memory(self, peer: str, geometry: dict[str, wire.RegionGeometry], mem_type: str) -> Any:
        """Prepare READs from a peer's regions (geometry checked, in our region order)."""

    @abstractmethod
    def _release_remote(self, remote: Any) -> None:
        """Release what `_connect_memory` prepared."""

    @abstractmethod
    def _create_span_read(self, peer: str, local: np.ndarray, remote: np.ndarray, mem_type: str,
                          notify: bytes) -> Any:
        """A READ of [N, 3] (address, bytes, device) rows, remote → local; its handle."""

    @abstractmethod
    def _start_read(self, handle: Any) -> str:
        """Post a created READ; 'ERR' if the data plane refused it."""

    @abstractmethod
    def _read_state(self, handle: Any) -> str:
        """'DONE', 'ERR', or anything else while in flight; raises when the peer is gone."""

    @abstractmethod
    def _release_read(self, handle: Any) -> None:
        """Free a READ's handle (cancelling it if still in flight)."""

    @abstractmethod
    def _close_backend(self) -> None:
        """Deregister memory and stop the endpoint."""

    # -- set-up --------------------------------------------------------------------------------
    def listen_at(self, host: str) -> None:
        if self._side is not None:
            if self._side.host == host:
                return
            self._side.close()
            self._side = None
        try:
            self._side = SideChannelServer(self._zmq, self, self.name, host, self.listen_port)
        except SideChannelError as exc:
            raise TransportError(str(exc)) from None

    def register(self, regions: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> None:
        self._check_open()
        if self._regions:
            raise TransportError("regions are already registered")
        built = build_regions(regions)
        self._register_memory(built, next(iter(built.values())).mem_type)
        self._regions = built
        self._digest = compat_hash(self.identity, [r.shape_key() for r in built.values()])

    def layout_digest(self) -> str:
        if self._digest is None:
            raise TransportError("register() the regions first")
        return self._digest

    # -- connecting (reader side) ------------------------------------------------------------
    def start_connect(self, peer: str, host: str, port: int, expected_hash: str | None = None,
                      timeout_s: float = 10.0) -> Handshake:
        self._check_open()
        expected = self.layout_digest() if expected_hash is None else expected_hash
        if peer in self._peers:
            p = self._peers[peer]
            if (p.host, p.port) == (host, port):
                return Handshake.connected(self, peer)
            self.disconnect(peer)
        if peer in self._connecting:
            return self._connecting[peer]
        hs = self._connecting[peer] = Handshake(self, peer, host, port, expected, timeout_s)
        return hs

    def _add_peer(self, peer: Peer) -> None:
        """A handshake completed."""
        self._peers[peer.name] = peer
        self._connecting.pop(peer.name, None)

    def disconnect(self, peer: str, reason: str = "disconnected", say_bye: bool = False) -> None:
        if say_bye and peer in self._peers:
            try:
                self._send(peer, wire.encode_handshake(wire.Bye()))
            except Exception:  # already gone: nothing to tell
                pass
        p = self._peers.pop(peer, None)
        if p is not None:
            for t in list(p.transfers):
                self._transfer_failed(t, f"READ from {peer} failed: {reason}", reason, drop_peer=False)
            quietly(lambda: self._release_remote(p.remote))
        self._forget_remote(peer)

    def is_connected(self, peer: str) -> bool:
        return peer in self._peers

    def peers(self) -> list[str]:
        return sorted(self._peers)

    def served(self) -> list[str]:
        return sorted(self._served)

    # -- transfers ---------------------------------------------------------------------------
    def read_spans(self, peer: str, spans: Sequence[tuple[str, int, int, int, int]], notify: bytes = b"",
                   timeout_s: float | None = 30.0) -> Transfer:
        self._check_open()
        p = self._peers.get(peer)
        if p is None:
            return Transfer.failed(self, peer, TransferFailed(f"not connected to {peer}", "not connected"))
        local, remote = span_rows(self._regions, p.geometry, spans)
        nbytes = int(local[:, 1].sum()) if len(local) else 0
        if not nbytes:
            if notify:
                self.send_notification(peer, notify)
            return Transfer.empty(self, peer)
        mem = self._regions[spans[0][0]].mem_type
        try:
            handle = self._create_span_read(peer, local, remote, mem, notify)
        except Exception as exc:
            return self._not_created(peer, exc)
        return self._post(p, handle, nbytes, timeout_s)

    def _not_created(self, peer: str, exc: Exception) -> Transfer:
        self.disconnect(peer, f"{type(exc).__name__}: {exc}")
        return Transfer.failed(self, peer, TransferFailed(f"READ from {peer} not created: {exc}", exc))

    def _post(self, p: Peer, handle: Any, nbytes: int, timeout_s: float | None) -> Transfer:
        t = Transfer(self, p.name, handle, nbytes, timeout_s)
        self._pending.add(t)
        p.transfers.add(t)
        try:
            status = self._start_read(handle)
        except Exception as exc:
            self._transfer_failed(t, f"READ from {p.name} not posted: {type(exc).__name__}: {exc}", exc,
                                  drop_peer=True)
            return t
        if status == "ERR":
            self._transfer_failed(t, f"READ from {p.name} not posted ({self.kind} status ERR)", "ERR",
                                  drop_peer=True)
        return t

    def _transfer_done(self, t: Transfer) -> None:
        quietly(lambda: self._release_read(t._handle))
        self._retire(t, "done")

    def _transfer_failed(self, t: Transfer, message: str, cause: Any, drop_peer: bool) -> None:
        t._error = TransferFailed(message, cause)
        if t._handle is not None:
            handle = t._handle
            quietly(lambda: self._release_read(handle))  # cancels a READ still in flight
        self._retire(t, "failed")
        if drop_peer and t.peer in self._peers:
            self.disconnect(t.peer, message)

    def _retire(self, t: Transfer, state: str) -> None:
        t.state, t.finished, t._handle = state, time.monotonic(), None
        self._pending.discard(t)
        p = self._peers.get(t.peer)
        if p is not None:
            p.transfers.discard(t)

    # -- notifications -----------------------------------------------------------------------
    def send_notification(self, peer: str, data: bytes) -> None:
        self._check_open()
        if wire.is_handshake(data) or len(data) > wire.MAX_NOTIFICATION_BYTES:
            raise ValueError("notification is reserved (handshake prefix) or too large")
        if peer not in self._peers and peer not in self._served:
            raise PeerUnavailable(f"no connection with {peer}")
        try:
            self._send(peer, data)
        except Exception as exc:
            self._drop(peer, f"{type(exc).__name__}: {exc}")
            raise PeerUnavailable(f"notification to {peer} failed: {exc}") from None

    def notifications(self) -> list[tuple[str, bytes]]:
        self.pump()
        out, self._inbox = self._inbox, []
        return out

    def pump(self) -> None:
        """Answer side-channel requests; collect notifications: handle handshakes, queue the rest
        for `notifications()`."""
        self._check_open()
        if self._side is not None:
            now = time.monotonic()
            for reader in self._side.serve():
                self._fetched[reader] = now
        for peer, messages in self._receive().items():
            for data in messages:
                if wire.is_handshake(data):
                    self._on_handshake(peer, data)
                else:
                    if peer in self._served:
                        self._served[peer] = time.monotonic()
                    self._inbox.append((peer, data))
        self._answer_hellos()

    # -- handshake, server side --------------------------------------------------------------
    def _on_handshake(self, peer: str, data: bytes) -> None:
        try:
            msg = wire.decode_handshake(data)
        except wire.ProtocolError as exc:
            log.warning("dropping a malformed handshake from %s: %s", peer, exc)
            return
        if isinstance(msg, wire.Hello):
            self._pending_hellos[peer] = _PendingHello(msg, time.monotonic())
        elif isinstance(msg, wire.HelloReply):
            hs = self._connecting.get(peer)
            if hs is not None:
                hs.on_reply(msg)
        else:  # Bye
            self._drop(peer, "peer closed")

    def _answer_hellos(self) -> None:
        for peer, pending in list(self._pending_hellos.items()):
            if not self.has_remote(peer):  # its metadata is still on its way
                if time.monotonic() - pending.since > _PENDING_HELLO_S:
                    del self._pending_hellos[peer]
                continue
            del self._pending_hellos[peer]
            self._answer(peer, pending.hello)

    def _answer(self, peer: str, hello: wire.Hello) -> None:
        ours = self.layout_digest()
        ok = hello.version == wire.HANDSHAKE_VERSION and hello.compat_hash == ours
        if ok:
            reply = wire.HelloReply(hello.nonce, True, ours, "", [r.geometry() for r in self._regions.values()])
        else:
            why = (f"handshake version {hello.version} != {wire.HANDSHAKE_VERSION}"
                   if hello.version != wire.HANDSHAKE_VERSION else
                   f"compatibility hash {hello.compat_hash[:16]}… != ours {ours[:16]}…")
            log.warning("refusing KV reader %s: %s", peer, why)
            reply = wire.HelloReply(hello.nonce, False, ours, why)
        try:
            self._send(peer, wire.encode_handshake(reply))
        except Exception as exc:  # stale metadata of an earlier incarnation: drop it, it will resend
            log.info("cannot answer %s (%s); dropping its metadata", peer, exc)
            self._forget_remote(peer)
            self._served.pop(peer, None)
            return
        if ok:
            self._served[peer] = time.monotonic()
        else:
            self._served.pop(peer, None)
            self._forget_remote(peer)

    def prune(self, idle_s: float) -> list[str]:
        now = time.monotonic()
        gone = [p for p, seen in self._served.items() if now - seen > idle_s]
        for p in gone:
            self._drop(p, "idle")
        # Readers that fetched our metadata but never completed a handshake: forget them too.
        for p, since in list(self._fetched.items()):
            if p in self._served or p in self._pending_hellos:
                self._fetched.pop(p)
            elif now - since > idle_s:
                self._fetched.pop(p)
                self._forget_remote(p)
        return gone

    def _drop(self, peer: str, reason: str) -> None:
        self._served.pop(peer, None)
        self._pending_hellos.pop(peer, None)
        if peer in self._peers:
            self.disconnect(peer, reason)
        else:
            self._forget_remote(peer)

    def _forget_remote(self, peer: str) -> None:
        if self._live and self.has_remote(peer):
            quietly(lambda: self.remove_remote(peer))

    # -- lifecycle ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"regions": sorted(self._regions), "peers": self.peers(), "served": self.served(),
                "connecting": sorted(self._connecting), "pending_transfers": len(self._pending),
                "closed": self.closed}

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.pump()  # peers that already said Bye are dropped, not sent one back
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        bye = wire.encode_handshake(wire.Bye())
        for peer in set(self._peers) | set(self._served):
            try:
                self._send(peer, bye)
            except Exception:  # already gone (it may have said Bye first): nothing to tell
                pass
        if self._peers or self._served:
            time.sleep(0.02)  # let the data plane put the Byes on the wire
        for hs in list(self._connecting.values()):
            hs.fail(PeerUnavailable(f"connect to {hs.peer}: transport closed"))
        for peer in list(self._peers):
            self.disconnect(peer, "transport closed")
        for peer in list(self._served) + list(self._pending_hellos):
            self._forget_remote(peer)
        self._served.clear()
        self._pending_hellos.clear()
        if self._side is not None:
            self._side.close()
            self._side = None
        self._zmq.destroy(linger=0)
        self._shut_backend()
        self._regions.clear()
        self.closed = True

    def _shut_backend(self) -> None:
        if self._live:
            self._live = False
            self._close_backend()

    def _check_open(self) -> None:
        if self.closed:
            raise TransportError("transport is closed")


def quietly(fn) -> None:
    """Cleanup that must not stop the cleanup after it; failures are logged."""
    try:
        fn()
    except Exception as exc:
        log.warning("KV transport cleanup step failed: %s: %s", type(exc).__name__, exc)
