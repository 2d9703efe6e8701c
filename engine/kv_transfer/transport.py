"""The KV transport seam: what the connector (kv_connector.py, decode_side.py, prefill_side.py)
asks of whatever moves KV blocks between a prefill and a decode engine.

A transport registers this engine's KV regions once, connects to a peer with a compatibility
check (`start_connect`, polled), READs byte spans of the peer's blocks into ours (`read_spans`,
polled), and carries small application notifications both ways (lease renewals and releases,
protocol.py). The connector never sees how: the one implementation today is NIXL
(nixl_transport.py), built on `PeerTransport` (peer_transport.py), which holds the protocol
itself (handshake, geometry, compatibility hash, transfer states) over a few data-plane
primitives; registry.py maps `--kv-transfer` to the class.

Errors are the protocol's, whatever the transport: `PeerUnavailable` (no answer, gone),
`IncompatiblePeer` (compatibility hash or geometry differ), `TransferFailed` (a READ that did not
complete: its bytes are garbage). Everything is driven by polling from one thread (the engine
loop); nothing here is thread-safe.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class TransportError(RuntimeError):
    """Base of the transport's failures."""


class PeerUnavailable(TransportError):
    """The peer did not answer (metadata or handshake timed out) or is disconnected."""


class IncompatiblePeer(TransportError):
    """The peer's compatibility hash or region geometry differs from ours."""


class TransferFailed(TransportError):
    """A READ did not complete; `cause` is the transport's error or the reason. Its bytes are garbage."""

    def __init__(self, message: str, cause: BaseException | str | None = None):
        super().__init__(message)
        self.cause = cause


class PendingConnect(Protocol):
    """A connection in progress: `poll()` → 'pending' | 'done', or raises TransportError."""

    peer: str

    def poll(self) -> str: ...


class PendingRead(Protocol):
    """One READ: `poll()` → 'pending' | 'done', or raises TransferFailed. `state` is 'pending',
    'done' or 'failed'; the blocks it writes are usable only once it is 'done'."""

    peer: str
    state: str
    nbytes: int
    started: float  # time.monotonic()
    finished: float | None

    def poll(self) -> str: ...

    def cancel(self, reason: str = "cancelled") -> None: ...


class KVTransport(ABC):
    """One engine's endpoint. Constructed as `cls(name, listen_port, identity=…, listen_host=…)`:
    `listen_port` None for a reader only (a decode); `identity` (JSON-able) goes into the
    compatibility hash with the regions' geometry."""

    name: str
    closed: bool

    # -- set-up ------------------------------------------------------------------------------
    @abstractmethod
    def register(self, regions: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> None:
        """Register every region's tensors (host or device memory, by tensor.device). Once."""

    @abstractmethod
    def layout_digest(self) -> str:
        """The compatibility hash both sides must share (identity + region geometry)."""

    @abstractmethod
    def listen_at(self, host: str) -> None:
        """Serve readers on `host` (at the listen port), moving there if listening elsewhere."""

    # -- connections (reader side) -----------------------------------------------------------
    @abstractmethod
    def start_connect(self, peer: str, host: str, port: int, expected_hash: str | None = None,
                      timeout_s: float = 10.0) -> PendingConnect:
        """Begin connecting to a server (at most one connection per peer); poll the result."""

    def connect(self, peer: str, host: str, port: int, expected_hash: str | None = None,
                timeout_s: float = 10.0) -> None:
        """Connect and validate compatibility, blocking. IncompatiblePeer on a hash or geometry
        mismatch, PeerUnavailable on timeout."""
        pending = self.start_connect(peer, host, port, expected_hash, timeout_s)
        while pending.poll() == "pending":
            time.sleep(0.002)

    @abstractmethod
    def is_connected(self, peer: str) -> bool:
        """Whether the handshake with this server completed (and it was not dropped since)."""

    @abstractmethod
    def peers(self) -> list[str]:
        """Servers this transport is connected to."""

    @abstractmethod
    def served(self) -> list[str]:
        """Readers this transport accepted."""

    @abstractmethod
    def disconnect(self, peer: str, reason: str = "disconnected", say_bye: bool = False) -> None:
        """Forget a server: fail its pending READs, drop what we hold of it (`say_bye`: tell it)."""

    @abstractmethod
    def prune(self, idle_s: float) -> list[str]:
        """Forget accepted readers silent for `idle_s`; returns their names."""

    # -- data ----------------------------------------------------------------------------------
    @abstractmethod
    def read_spans(self, peer: str, spans: Sequence[tuple[str, int, int, int, int]], notify: bytes = b"",
                   timeout_s: float | None = 30.0) -> PendingRead:
        """One READ of byte ranges inside blocks: each span (region, local block, remote block,
        byte offset, bytes) in every tensor of the region. The peer gets `notify` once it
        completed. KeyError / ValueError for spans outside the regions."""

    # -- notifications -------------------------------------------------------------------------
    @abstractmethod
    def send_notification(self, peer: str, data: bytes) -> None:
        """Application bytes to a connected server or an accepted reader (PeerUnavailable if neither)."""

    @abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """Application notifications since the last call, as (peer, bytes). A server calls this
        every step: it also answers connecting readers."""

    # -- lifecycle -----------------------------------------------------------------------------
    @abstractmethod
    def state(self) -> dict[str, Any]:
        """{'regions', 'peers', 'served', 'connecting', 'pending_transfers', 'closed'} (stats, tests)."""

    @abstractmethod
    def close(self) -> None:
        """Tell peers goodbye, cancel READs, release everything registered. Idempotent."""

    def __enter__(self) -> "KVTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
