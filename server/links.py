"""How the engine client reaches one rank: its four channels and its life.

Channels: `requests` and `control` go to the rank, `outputs` and `status` come from it; each
carries codec bytes (ipc/codec.py). A `LocalLink` is a rank on this node: four shared-memory
rings and the worker process (watched through its pidfd). A `RemoteLink` is a rank on another
node (multi-node data parallelism): its messages travel through that node's agent
(server/node.py) over one ZeroMQ connection, `NodeChannel` on this side. The engine client
treats both alike.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from ipc import RingConfig, RingReader, RingWriter
from ipc.errors import RingClosed

from .worker_entry import WorkerArgs, WorkerProcess

logger = logging.getLogger(__name__)

CONTROL_RING = RingConfig(slot_bytes=64 << 10, num_slots=64)
STATUS_RING = RingConfig(slot_bytes=4096, num_slots=64)
CHANNELS = ("requests", "control", "outputs", "status")


class RankLink(ABC):
    def __init__(self, rank: int):
        self.rank = rank

    @abstractmethod
    async def send(self, channel: str, data: bytes, timeout: float) -> None:
        """Deliver `data` on 'requests' or 'control' (waits, bounded, while the channel is full)."""

    @abstractmethod
    def send_now(self, channel: str, data: bytes, timeout: float) -> None:
        """Best-effort synchronous send (shutdown)."""

    @abstractmethod
    async def recv(self, channel: str, timeout: float) -> bytes:
        """The next message on 'outputs' or 'status'; RingClosed once the rank closed it."""

    @abstractmethod
    def poll(self, channel: str) -> bytes | None:
        """The next message if one is there now."""

    @abstractmethod
    def capacity(self, channel: str) -> int:
        """Largest message the channel takes."""

    @abstractmethod
    def is_alive(self) -> bool: ...

    @property
    @abstractmethod
    def exitcode(self) -> int | None: ...

    @abstractmethod
    def watch_exit(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        """Call `callback` once, on `loop`, when the rank has exited."""

    @abstractmethod
    def unwatch_exit(self) -> None:
        """Stop watching (shutdown: an exit we asked for is not a failure)."""

    @abstractmethod
    def kill(self) -> None: ...

    @abstractmethod
    async def wait_exit(self, timeout: float) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Release what the link holds (rings unlinked, fds closed)."""


class LocalLink(RankLink):
    """A rank of this node: rings in /dev/shm, a worker process."""

    def __init__(self, rank: int, ring_config: RingConfig, make_args: Callable[..., WorkerArgs]):
        super().__init__(rank)
        self.requests = RingWriter.create(ring_config)
        self.control = RingWriter.create(CONTROL_RING)
        self.outputs = RingReader.create(ring_config)
        self.status = RingReader.create(STATUS_RING)
        self.process = WorkerProcess(make_args(self.requests.name, self.control.name, self.outputs.name,
                                               self.status.name))
        self._loop: asyncio.AbstractEventLoop | None = None

    def _ring(self, channel: str):
        return getattr(self, channel)

    async def send(self, channel: str, data: bytes, timeout: float) -> None:
        await self._ring(channel).put_async(data, timeout=timeout)

    def send_now(self, channel: str, data: bytes, timeout: float) -> None:
        self._ring(channel).put(data, timeout=timeout)

    async def recv(self, channel: str, timeout: float) -> bytes:
        return await self._ring(channel).get_async(timeout=timeout)

    def poll(self, channel: str) -> bytes | None:
        return self._ring(channel).poll()

    def capacity(self, channel: str) -> int:
        return self._ring(channel).capacity

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def watch_exit(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        def fire() -> None:
            loop.remove_reader(self.process.sentinel)
            self._loop = None
            self.process.join(timeout=1)
            callback()

        self._loop = loop
        loop.add_reader(self.process.sentinel, fire)

    def unwatch_exit(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.process.sentinel)
        self._loop = None

    def kill(self) -> None:
        self.process.kill()

    async def wait_exit(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.process.is_alive() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)

    def close(self) -> None:
        self.unwatch_exit()
        self.process.close()
        for ring in (self.requests, self.control, self.outputs, self.status):
            ring.close()


# ---- ranks on other nodes -------------------------------------------------------------------

class NodeHello(msgspec.Struct, frozen=True, array_like=True, tag=1):
    """A headless node joins: the ranks it runs and a digest of its configuration."""

    first_rank: int
    num_ranks: int
    config_digest: str


class NodeWelcome(msgspec.Struct, frozen=True, array_like=True, tag=2):
    """The head accepts a node: the group's generation (its ranks rendezvous under it)."""

    generation: str


class NodeRefused(msgspec.Struct, frozen=True, array_like=True, tag=3):
    reason: str


class RankMessage(msgspec.Struct, frozen=True, array_like=True, tag=4):
    """One codec message for (or from) one rank's channel."""

    rank: int
    channel: int  # index into CHANNELS
    payload: bytes


class RankExited(msgspec.Struct, frozen=True, array_like=True, tag=5):
    rank: int
    exitcode: int
    reason: str


class NodeBye(msgspec.Struct, frozen=True, array_like=True, tag=6):
    """Head → node: stop your ranks (shutdown); node → head: my ranks have stopped."""

    reason: str


class NodeAlive(msgspec.Struct, frozen=True, array_like=True, tag=7):
    """Node → head, every NODE_ALIVE_S: the node itself is up, even while its ranks load (a
    large checkpoint takes minutes, during which the ranks send nothing)."""


NODE_ALIVE_S = 1.0

NodeMessage = NodeHello | NodeWelcome | NodeRefused | RankMessage | RankExited | NodeBye | NodeAlive
ENCODE = msgspec.msgpack.Encoder().encode
DECODE = msgspec.msgpack.Decoder(NodeMessage).decode


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
        item = await asyncio.wait_for(self.inbox[channel].get(), timeout)
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


# ZeroMQ's own ping/pong (ZMTP heartbeats): a peer that stops answering is disconnected.
ZMQ_HEARTBEAT_MS = 1000
ZMQ_HEARTBEAT_TIMEOUT_MS = 10_000


def heartbeat_socket(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ZMQ_HEARTBEAT_TIMEOUT_MS)
    return sock


class NodeChannel:
    """The head's side of every headless node: one ZeroMQ ROUTER on the rpc port.

    A node sends NodeAlive every NODE_ALIVE_S from its own loop (so also while its ranks load) and
    its ranks send a heartbeat every 0.25 s (from a worker thread, so even during a long step); a
    node the head has heard nothing from for `node_timeout_s` (its machine or network is gone) has
    its ranks declared exited, like a dead local worker."""

    def __init__(self, address: str, port: int, node_timeout_s: float = 15.0):
        self.ctx = zmq.asyncio.Context()
        self.sock = heartbeat_socket(self.ctx.socket(zmq.ROUTER))
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished node fails, never drops silently
        try:
            self.sock.bind(f"tcp://{address}:{port}")
        except zmq.ZMQError as exc:
            self.sock.close(linger=0)
            self.ctx.term()
            raise OSError(f"cannot listen for headless nodes on {address}:{port}: {exc}") from None
        self.node_timeout_s = node_timeout_s
        self.links: dict[int, RemoteLink] = {}
        self.last_heard: dict[bytes, float] = {}  # node id → loop time of its last message
        self._task: asyncio.Task | None = None

    async def accept(self, expected: list[tuple[int, int]], digest: str, generation: str, capacity: int,
                     timeout: float) -> list[RemoteLink]:
        """Wait for the nodes that run `expected` (first rank, ranks) to say hello; welcome the ones
        whose configuration digest matches, refuse the rest. Returns their ranks' links."""
        missing = set(expected)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while missing:
            left = deadline - loop.time()
            if left <= 0 or not await self.sock.poll(timeout=int(left * 1000)):
                names = sorted(r for first, n in missing for r in range(first, first + n))
                raise TimeoutError(f"no headless node for ranks {names} joined within {timeout:g} s "
                                   f"(start them with --headless --data-parallel-start-rank …)")
            node_id, raw = await self.sock.recv_multipart()
            try:
                msg = DECODE(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if not isinstance(msg, NodeHello):
                continue
            key = (msg.first_rank, msg.num_ranks)
            if node_id in self.last_heard:  # a node repeats its hello until answered: answer again
                reply = NodeWelcome(generation)
            elif key not in missing or msg.config_digest != digest:
                why = ("its configuration differs from the head's (serve both with the same model and flags)"
                       if key in missing else f"no node is expected for ranks {key}")
                logger.error("refused a headless node for ranks %s: %s", key, why)
                reply = NodeRefused(why)
            else:
                missing.discard(key)
                self.last_heard[node_id] = loop.time()
                for rank in range(msg.first_rank, msg.first_rank + msg.num_ranks):
                    self.links[rank] = RemoteLink(rank, self, node_id, capacity)
                reply = NodeWelcome(generation)
            try:
                await self.sock.send_multipart([node_id, ENCODE(reply)])
            except zmq.ZMQError:  # that connection closed meanwhile; its node says hello again
                pass
        self._task = asyncio.ensure_future(self._receive())
        return [self.links[r] for r in sorted(self.links)]

    async def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not await self.sock.poll(timeout=1000):
                self._check_silence(loop.time())
                continue
            node_id, raw = await self.sock.recv_multipart()
            if node_id in self.last_heard:
                self.last_heard[node_id] = loop.time()
            try:
                msg = DECODE(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("node channel: undecodable message from a node (%s); ignored", exc)
                continue
            link = self.links.get(getattr(msg, "rank", -1))
            if isinstance(msg, RankMessage) and link is not None and link.node_id == node_id:
                queue = link.inbox.get(CHANNELS[msg.channel]) if 0 <= msg.channel < len(CHANNELS) else None
                if queue is not None:
                    queue.put_nowait(msg.payload)
            elif isinstance(msg, RankExited) and link is not None and link.node_id == node_id:
                link.exited(msg.exitcode, msg.reason)
            elif isinstance(msg, NodeBye):
                self._node_gone(node_id, f"its node stopped: {msg.reason}")
            self._check_silence(loop.time())

    def _check_silence(self, now: float) -> None:
        for node_id, heard in list(self.last_heard.items()):
            if now - heard > self.node_timeout_s:
                self._node_gone(node_id, f"its node sent nothing for {now - heard:.0f} s (machine or network lost)")

    def _node_gone(self, node_id: bytes, reason: str) -> None:
        self.last_heard.pop(node_id, None)
        for link in self.links.values():
            if link.node_id == node_id:
                link.exited(1, reason)

    async def send(self, node_id: bytes, msg) -> None:
        try:
            await self.sock.send_multipart([node_id, ENCODE(msg)])
        except zmq.ZMQError as exc:  # the node is not connected (ROUTER_MANDATORY): it is gone
            self._node_gone(node_id, f"its node is unreachable ({exc})")
            raise RingClosed(f"headless node unreachable: {exc}") from None

    def send_nowait(self, node_id: bytes, msg) -> None:
        """Queue a send on the loop without waiting for it (shutdown; best effort)."""
        future = asyncio.ensure_future(self.sock.send_multipart([node_id, ENCODE(msg)]))
        future.add_done_callback(lambda f: f.exception())  # a vanished node is not an error here

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
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close(linger=0)
        self.ctx.term()
