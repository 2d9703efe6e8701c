"""The head's side of multi-node data parallelism: one ZeroMQ ROUTER on the rpc port.

Who may connect: with a cluster key, only holders of it (CURVE, ipc/cluster_auth.py; a
stranger fails the handshake and none of its bytes reach this code); without one, the port is on
loopback (or the operator said --insecure-cluster). Either way the receive loop trusts nothing:

  * a message of any other frame count than [sender, body] is dropped;
  * a sender not welcomed yet may only say hello, in at most MAX_HELLO_BYTES (checked before
    decoding); a welcomed node's messages are capped at its ranks' ring capacity;
  * a node speaks only for its own ranks and only on their outgoing channels;
  * every drop is counted and logged at most once a second per peer (ipc/channel_guard.py).

A node sends NodeAlive every NODE_ALIVE_S from its own loop (so also while its ranks load) and
its ranks send a heartbeat every 0.25 s (from a worker thread, so even during a long step); a
node the head has heard nothing from for `node_timeout_s` (its machine or network is gone) has
its ranks declared exited, like a dead local worker. If the receive loop itself dies, every
remote rank is declared exited with the cause: the server exits 1, never half alive.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from ipc.errors import RingClosed

from ipc import cluster_auth
from ipc.channel_guard import DropLog, HandshakeMonitor, cancel_and_wait, guarded
from .node_wire import (DECODE, ENCODE, ENVELOPE_BYTES, FROM_RANK, MAX_HELLO_BYTES, NodeAlive, NodeBye, NodeHello,
                        NodeRefused, NodeWelcome, RankExited, RankMessage, heartbeat_socket)
from .rank_link import CHANNELS, RankLink

logger = logging.getLogger(__name__)


class RemoteLink(RankLink):
    """A rank on a headless node, reached through that node's agent."""

    def __init__(self, rank: int, channel: "NodeChannel", node_id: bytes, capacity: int):
        super().__init__(rank)
        self.node, self.node_id, self._capacity = channel, node_id, capacity
        self.inbox = {"outputs": asyncio.Queue(), "status": asyncio.Queue()}
        self._exitcode: int | None = None
        self.reason = ""
        self._on_exit: list[Callable[[], None]] = []

    async def send(self, channel: str, data: bytes, timeout: float) -> None:
        await self.node.send(self.node_id, RankMessage(self.rank, CHANNELS.index(channel), data))

    def send_now(self, channel: str, data: bytes, timeout: float) -> None:
        self.node.send_nowait(self.node_id, RankMessage(self.rank, CHANNELS.index(channel), data))

    async def recv(self, channel: str, timeout: float) -> bytes:
        async with asyncio.timeout(timeout):  # not wait_for: see ipc.ring_base._park_async
            item = await self.inbox[channel].get()
        if item is None:
            raise RingClosed(f"rank {self.rank} on a remote node has exited")
        return item

    def poll(self, channel: str) -> bytes | None:
        try:
            item = self.inbox[channel].get_nowait()
        except asyncio.QueueEmpty:
            return None
        if item is None:
            raise RingClosed(f"rank {self.rank} on a remote node has exited")
        return item

    def capacity(self, channel: str) -> int:
        return self._capacity

    def is_alive(self) -> bool:
        return self._exitcode is None

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    def exited(self, code: int, reason: str) -> None:
        """The node reports the rank gone (or the node itself is gone)."""
        if self._exitcode is not None:
            return
        self._exitcode, self.reason = code, reason
        for q in self.inbox.values():
            q.put_nowait(None)
        for callback in self._on_exit:
            callback()

    def watch_exit(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self._on_exit.append(callback)

    def unwatch_exit(self) -> None:
        self._on_exit.clear()

    def kill(self) -> None:
        """A rank on another node cannot be killed from here: its node is told to stop (every
        rank of it: a node runs as one unit)."""
        self.node.send_nowait(self.node_id, NodeBye(f"rank {self.rank} must stop"))

    async def wait_exit(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._exitcode is None and loop.time() < deadline:
            await asyncio.sleep(0.02)

    def close(self) -> None:
        self._on_exit.clear()


class NodeChannel:
    """See the module docstring. `accept` waits for the expected nodes; from then on the links
    it returned carry their ranks' messages."""

    def __init__(self, address: str, port: int, node_timeout_s: float = 15.0,
                 auth: cluster_auth.ClusterAuth | None = None):
        auth = auth or cluster_auth.current()
        auth.check_listen(address, f"the node port {port} (--data-parallel-rpc-port)")
        self.ctx = zmq.asyncio.Context()
        self.sock = heartbeat_socket(self.ctx.socket(zmq.ROUTER))
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished node fails, never drops silently
        self.zap = auth.secure_server(self.sock, cluster_auth.NODE_CHANNEL)
        self.monitor = HandshakeMonitor(self.sock, cluster_auth.NODE_CHANNEL)
        try:
            self.sock.bind(cluster_auth.tcp_endpoint(self.sock, address, port))
        except (zmq.ZMQError, OSError) as exc:
            self._release()
            raise OSError(f"cannot listen for headless nodes on {address}:{port}: {exc}") from None
        self.node_timeout_s = node_timeout_s
        self.links: dict[int, RemoteLink] = {}
        self.last_heard: dict[bytes, float] = {}  # welcomed node id → loop time of its last message
        self.drops = DropLog(cluster_auth.NODE_CHANNEL)
        self.failure: str | None = None
        self._expected: set[tuple[int, int]] = set()
        self._digest = self._generation = ""
        self._max_bytes = MAX_HELLO_BYTES
        self._joined = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def accept(self, expected: list[tuple[int, int]], digest: str, generation: str, capacity: int,
                     timeout: float) -> list[RemoteLink]:
        """Wait for the nodes that run `expected` (first rank, ranks) to say hello; welcome the ones
        whose configuration digest matches, refuse the rest. Returns their ranks' links."""
        self._expected, self._digest, self._generation = set(expected), digest, generation
        self._capacity = capacity
        self._max_bytes = capacity + ENVELOPE_BYTES
        self.sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)  # connections from now on
        self._tasks = [asyncio.ensure_future(guarded(self._receive(), self._fail, "the node channel's receive loop")),
                       asyncio.ensure_future(guarded(self.monitor.run(), self._fail, "the node channel's monitor"))]
        if not self._expected:
            self._joined.set()
        try:
            await asyncio.wait_for(self._joined.wait(), timeout)
        except asyncio.TimeoutError:
            names = sorted(r for first, n in self._expected for r in range(first, first + n))
            raise TimeoutError(f"no headless node for ranks {names} joined within {timeout:g} s "
                               f"(start them with --headless --data-parallel-start-rank …)") from None
        if self.failure is not None:
            raise ConnectionError(self.failure)
        return [self.links[r] for r in sorted(self.links)]

    # ---- receiving -------------------------------------------------------------------------
    async def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if await self.sock.poll(timeout=1000):
                self._handle(await self.sock.recv_multipart(), loop.time())
            self._check_silence(loop.time())

    def _handle(self, frames: list[bytes], now: float) -> None:
        if len(frames) != 2:
            self.drops.drop(frames[0], "frames", f"{len(frames) - 1} body frames, 1 expected")
            return
        node_id, raw = frames
        if node_id not in self.last_heard:
            self._from_stranger(node_id, raw)
            return
        if len(raw) > self._max_bytes:
            self.drops.drop(node_id, "oversize", f"{len(raw)} bytes, at most {self._max_bytes}")
            return
        self.last_heard[node_id] = now
        try:
            msg = DECODE(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.drops.drop(node_id, "undecodable", str(exc))
            return
        link = self.links.get(getattr(msg, "rank", -1))
        own = link is not None and link.node_id == node_id
        if isinstance(msg, RankMessage) and own and msg.channel in FROM_RANK:
            link.inbox[CHANNELS[msg.channel]].put_nowait(msg.payload)
        elif isinstance(msg, RankExited) and own:
            link.exited(msg.exitcode, msg.reason)
        elif isinstance(msg, NodeBye):
            self._node_gone(node_id, f"its node stopped: {msg.reason}")
        elif isinstance(msg, NodeHello):  # it repeats its hello until answered: answer again
            self._reply(node_id, NodeWelcome(self._generation))
        elif not isinstance(msg, NodeAlive):
            self.drops.drop(node_id, "not_allowed", f"{type(msg).__name__} for rank {getattr(msg, 'rank', '-')}")

    def _from_stranger(self, node_id: bytes, raw: bytes) -> None:
        """A sender not welcomed: only a hello, small, for ranks still expected, with our digest."""
        if len(raw) > MAX_HELLO_BYTES:
            self.drops.drop(node_id, "oversize", f"{len(raw)} bytes from a sender that has not said hello")
            return
        try:
            msg = DECODE(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.drops.drop(node_id, "undecodable", str(exc))
            return
        if not isinstance(msg, NodeHello):
            self.drops.drop(node_id, "unknown_sender", f"{type(msg).__name__} before a hello")
            return
        key = (msg.first_rank, msg.num_ranks)
        if key not in self._expected:
            taken = msg.first_rank in self.links
            why = f"ranks {key} already joined from another node" if taken else f"no node is expected for ranks {key}"
        elif msg.config_digest != self._digest:
            why = "its configuration differs from the head's (serve both with the same model and flags)"
        else:
            self._welcome(node_id, key)
            return
        self.drops.drop(node_id, "refused", f"hello for ranks {key}: {why}")
        self._reply(node_id, NodeRefused(why))

    def _welcome(self, node_id: bytes, key: tuple[int, int]) -> None:
        self._expected.discard(key)
        self.last_heard[node_id] = asyncio.get_running_loop().time()
        first, n = key
        for rank in range(first, first + n):
            self.links[rank] = RemoteLink(rank, self, node_id, self._capacity)
        logger.info("welcomed the headless node for ranks %d-%d", first, first + n - 1)
        self._reply(node_id, NodeWelcome(self._generation))
        if not self._expected:
            self._joined.set()

    def _reply(self, node_id: bytes, msg) -> None:
        """Answer without waiting (a node whose connection closed meanwhile says hello again)."""
        future = asyncio.ensure_future(self.sock.send_multipart([node_id, ENCODE(msg)]))
        future.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _check_silence(self, now: float) -> None:
        for node_id, heard in list(self.last_heard.items()):
            if now - heard > self.node_timeout_s:
                self._node_gone(node_id, f"its node sent nothing for {now - heard:.0f} s (machine or network lost)")

    def _node_gone(self, node_id: bytes, reason: str) -> None:
        self.last_heard.pop(node_id, None)
        for link in self.links.values():
            if link.node_id == node_id:
                link.exited(1, reason)

    def _fail(self, reason: str) -> None:
        """A receive task died: every remote rank is lost with the cause (the server exits 1)."""
        self.failure = reason
        for link in self.links.values():
            link.exited(1, reason)
        self._joined.set()  # an accept() still waiting raises the failure

    # ---- sending ---------------------------------------------------------------------------
    async def send(self, node_id: bytes, msg) -> None:
        try:
            await self.sock.send_multipart([node_id, ENCODE(msg)])
        except zmq.ZMQError as exc:  # the node is not connected (ROUTER_MANDATORY): it is gone
            self._node_gone(node_id, f"its node is unreachable ({exc})")
            raise RingClosed(f"headless node unreachable: {exc}") from None

    def send_nowait(self, node_id: bytes, msg) -> None:
        """Queue a send on the loop without waiting for it (shutdown; best effort)."""
        self._reply(node_id, msg)

    async def say_bye(self, reason: str, timeout: float) -> None:
        """Tell every node to stop its ranks, and wait (bounded) until each said it stopped."""
        nodes = {link.node_id for link in self.links.values() if link.is_alive()}
        for node_id in nodes:
            try:
                await asyncio.wait_for(self.sock.send_multipart([node_id, ENCODE(NodeBye(reason))]), 1.0)
            except (asyncio.TimeoutError, zmq.ZMQError):
                self._node_gone(node_id, "its node is unreachable")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(link.is_alive() for link in self.links.values()) and loop.time() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._release()

    def _release(self) -> None:
        self.monitor.close()
        self.sock.close(linger=0)
        if self.zap is not None:
            self.zap.stop()
        self.ctx.term()
