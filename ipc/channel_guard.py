"""What the internal channels refuse: counted on /metrics, logged without flooding the journal.

Every receive loop on an internal socket (node channel, rendezvous store, KV side channel) drops
what it cannot use — a wrong number of frames, an oversized or undecodable message, a message
from a sender it does not know or may not send it — and goes on. Each drop increments
`ringserve:internal_messages_dropped_total{channel, reason}` and is logged at most once a second
per peer (and a few lines a second per channel, since a stranger can reconnect under new
identities), with a count of what was suppressed in between.

ZeroMQ itself ends connections that fail the handshake (no or a wrong cluster key, bytes that
are not ZMTP) or send a frame over the socket's size cap (checked from the length header,
before anything is allocated); `HandshakeMonitor` counts those from the socket's monitor events.

The counters live in one registry per process (`REGISTRY`), which the HTTP server's /metrics
appends to its own; worker processes and headless nodes have no /metrics and only log.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

import zmq
from prometheus_client import CollectorRegistry, Counter
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)
DROPPED = Counter("ringserve:internal_messages_dropped", "Messages an internal channel dropped unread or unused "
                  "(wrong frame count, oversized, undecodable, unknown sender, not allowed).",
                  ["channel", "reason"], registry=REGISTRY)
REFUSED = Counter("ringserve:internal_connections_refused", "Connections to an internal channel whose handshake "
                  "failed (no or a wrong cluster key, or bytes that are not ZeroMQ).", ["channel"], registry=REGISTRY)
CLOSED = Counter("ringserve:internal_connections_closed", "Connections to an internal channel that ended (a peer "
                 "leaving, or the transport cutting one that sent an oversized frame).", ["channel"],
                 registry=REGISTRY)

LOG_INTERVAL_S = 1.0  # per peer
CHANNEL_LINES_PER_S = 5  # per channel, whatever the number of peers
_MAX_PEERS = 1024  # peers remembered for rate limiting


class DropLog:
    """Counts and logs the drops of one channel."""

    def __init__(self, channel: str):
        self.channel = channel
        self._peers: dict[object, tuple[float, int]] = {}  # peer → (last line, drops suppressed since)
        self._window = (0.0, 0)  # (second, lines written in it) for the whole channel

    def drop(self, peer: object, reason: str, detail: str = "") -> None:
        DROPPED.labels(self.channel, reason).inc()
        now = time.monotonic()
        last, suppressed = self._peers.pop(peer, (-LOG_INTERVAL_S, 0))
        second, lines = self._window
        if int(now) != second:
            second, lines = int(now), 0
        if now - last < LOG_INTERVAL_S or lines >= CHANNEL_LINES_PER_S:
            self._remember(peer, last, suppressed + 1)
            return
        self._window = (second, lines + 1)
        more = f" (and {suppressed} more from it since the last line)" if suppressed else ""
        logger.warning("%s: dropped a message from %s: %s%s%s", self.channel, _peer_name(peer), reason,
                       f" ({detail})" if detail else "", more)
        self._remember(peer, now, 0)

    def _remember(self, peer: object, last: float, suppressed: int) -> None:
        if len(self._peers) >= _MAX_PEERS:
            self._peers.pop(next(iter(self._peers)))
        self._peers[peer] = (last, suppressed)


def _peer_name(peer: object) -> str:
    return peer.hex() if isinstance(peer, bytes) else str(peer)


_MONITOR_SERIAL = itertools.count()


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket receiving `sock`'s monitor `events`, on an inproc address used once.

    pyzmq's default address is derived from the socket's file descriptor, and ZeroMQ releases an
    inproc endpoint only when its reaper gets to it after `disable_monitor`: a second monitor on
    the same socket (or on a new socket given the same descriptor) could then fail with "Address
    already in use" on a loaded machine. A fresh name per monitor cannot collide."""
    return sock.get_monitor_socket(events, addr=f"inproc://ringserve-monitor-{os.getpid()}-{next(_MONITOR_SERIAL)}")


class HandshakeMonitor:
    """Counts a listening socket's failed handshakes and closed connections (monitor events)."""

    EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)

    def __init__(self, sock: zmq.Socket, channel: str):
        self.channel = channel
        self.monitor = monitor_socket(sock, self.EVENTS)
        self._sock = sock
        self._logged_at = -LOG_INTERVAL_S
        self._refused_since_log = 0

    def handle(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            CLOSED.labels(self.channel).inc()
            return
        REFUSED.labels(self.channel).inc()
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_INTERVAL_S:
            logger.warning("%s: refused %d connection(s) that failed the handshake (no or a wrong cluster key, "
                           "or not ZeroMQ)", self.channel, self._refused_since_log)
            self._logged_at, self._refused_since_log = now, 0

    def poll(self) -> None:
        """Handle the events waiting now (a synchronous socket's owner calls this in its loop)."""
        while self.monitor.poll(0):
            self.handle(self.monitor.recv_multipart())

    async def run(self) -> None:
        """Handle events as they come (an asyncio socket's owner runs this as a task)."""
        while True:
            self.handle(await self.monitor.recv_multipart())

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)


async def cancel_and_wait(tasks: list[asyncio.Future]) -> None:
    """Cancel `tasks` and wait until every one has ended. A task that swallowed its cancel (a
    library's wait that completed in the same loop pass) is cancelled again, so a stop never
    waits forever on a loop that went on."""
    while pending := [t for t in tasks if not t.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=1.0)
    await asyncio.gather(*tasks, return_exceptions=True)  # retrieve their exceptions


async def guarded(coro, on_failure, what: str) -> None:
    """Run a receive loop; if it ends by an exception (a bug: loops drop bad input themselves),
    log the cause and hand it to `on_failure` — the owner takes the server down with it, never
    leaving it half alive."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure of a receive loop is fatal to its owner
        logger.critical("%s died: %s: %s", what, type(exc).__name__, exc, exc_info=exc)
        on_failure(f"{what} died: {type(exc).__name__}: {exc}")
