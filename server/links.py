"""How the engine client reaches one rank: its four channels and its life.

Channels: `requests` and `control` go to the rank, `outputs` and `status` come from it; each
carries codec bytes (ipc/codec.py). A `LocalLink` is a rank on this node: four shared-memory
rings and the worker process (watched through its pidfd). A `RemoteLink` is a rank on another
node (multi-node data parallelism): its messages travel through that node's agent
(server/node.py) over one ZeroMQ connection, `NodeChannel` on this side (server/node_channel.py,
its vocabulary in server/node_wire.py). The engine client treats both alike.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ipc import RingConfig, RingReader, RingWriter

from .node_channel import NodeChannel, RemoteLink  # noqa: F401 - re-exported: the engine client's links
from .node_wire import (DECODE, ENCODE, NODE_ALIVE_S, NodeAlive, NodeBye, NodeHello,  # noqa: F401 - re-exported
                        NodeRefused, NodeWelcome, RankExited, RankMessage, heartbeat_socket)
from .rank_link import CHANNELS, RankLink
from .worker_entry import WorkerArgs, WorkerProcess

logger = logging.getLogger(__name__)

CONTROL_RING = RingConfig(slot_bytes=64 << 10, num_slots=64)
STATUS_RING = RingConfig(slot_bytes=4096, num_slots=64)


class LocalLink(RankLink):
    """A rank of this node: rings in /dev/shm, a worker process."""

    def __init__(self, rank: int, ring_config: RingConfig, make_args: Callable[..., WorkerArgs],
                 output_config: RingConfig | None = None):
        super().__init__(rank)
        self.requests = RingWriter.create(ring_config)
        self.control = RingWriter.create(CONTROL_RING)
        self.outputs = RingReader.create(output_config or ring_config)  # no images come back: it can be smaller
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
