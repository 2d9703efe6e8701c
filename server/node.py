"""A headless node (`ringserve serve --headless`): this node's ranks, and no HTTP server.

It joins the head over the head's rpc port (ZeroMQ; retrying with back-off until the
rendezvous timeout, since nodes start in any order), learns the group's generation, starts its
ranks (which then rendezvous with the others on the head's store), and from then on relays
codec bytes between the head and its ranks' rings: requests and control in, outputs and status
out. It never decodes them; the ranks and the head do.

A rank that exits is reported to the head and ends this node with status 1 (an expert-parallel
group cannot heal; systemd restarts the node, which joins the next generation). SIGTERM, or the
head saying bye, stops the ranks and exits 0. So does any of its relay tasks dying (status 1,
with the cause): a node never runs half alive.

The connection is keyed like the head's port (ipc/cluster_auth.py): a head that refuses this
node's handshake (the cluster keys differ, or only one side has one) ends the join at once with
one line saying so, rather than after the rendezvous timeout. What the head sends is checked
like anything else received: a message that does not decode, or names a rank or a channel this
node does not serve, is dropped and counted.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig, ParallelConfig
from ipc import Shutdown, WorkerReady, decode
from ipc.errors import IpcError, RingClosed, RingTimeout
from ipc.segment import remove_orphans

from ipc import cluster_auth
from ipc.channel_guard import DropLog, cancel_and_wait, guarded, monitor_socket
from .engine_client import config_digest, request_ring, worker_device
from .links import LocalLink
from .node_wire import (DECODE, ENCODE, ENVELOPE_BYTES, NODE_ALIVE_S, TO_RANK, NodeAlive, NodeBye, NodeHello,
                        NodeRefused, NodeWelcome, RankExited, RankMessage, heartbeat_socket)
from .rank_link import CHANNELS
from .worker_entry import WorkerArgs

logger = logging.getLogger(__name__)


class NodeError(ConnectionError):
    """The node could not join (refused, or no head within the timeout): one line says why
    (an OSError, so the CLI prints it as one line and exits 2)."""


class HeadlessNode:
    def __init__(self, model_dir: str, config: EngineConfig, parallel: ParallelConfig, device: str = "cpu",
                 threads_per_worker: int | None = None, auth: cluster_auth.ClusterAuth | None = None,
                 image_bytes: int = 0):
        import os

        self.model_dir, self.config, self.parallel, self.device = str(model_dir), config, parallel, device
        self.threads = threads_per_worker or max(1, (os.cpu_count() or 1) // parallel.local_size)
        self.auth = auth or cluster_auth.current()
        # This node's ranks listen too (their gloo/NCCL ports, on the interface toward the head).
        self.auth.check_listen(parallel.data_parallel_address, "this node's ranks (toward the head at "
                               f"{parallel.data_parallel_address})")
        self.ring = request_ring(config.max_model_len, image_bytes)  # image_bytes: as the head's (serve.py)
        self.drops = DropLog(cluster_auth.NODE_CHANNEL)
        self.ctx = zmq.asyncio.Context()
        self.sock: zmq.asyncio.Socket | None = None
        self.links: dict[int, LocalLink] = {}
        self.exit_code = 0
        self.failure = ""  # why the node stopped, when it failed
        self._ready: set[int] = set()  # ranks that sent WorkerReady
        self.on_ready: list = []  # callbacks() once every rank is ready
        self._stop = asyncio.Event()

    async def run(self) -> int:
        remove_orphans()
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Future] = []
        for sig in (signal.SIGTERM, signal.SIGINT):  # from the start: a stop while joining is honoured
            loop.add_signal_handler(sig, self._stop.set)
        try:
            join = asyncio.ensure_future(self._join())
            stopped = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait([join, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not join.done():
                join.cancel()
                await asyncio.gather(join, return_exceptions=True)
                return self.exit_code
            self._start_ranks(join.result())  # NodeError if the head refused or never answered
            jobs = [(self._from_head(), "the relay from the head"), (self._watch_head(), "the head watcher"),
                    (self._keep_alive(), "the keep-alive")]
            for link in self.links.values():
                link.watch_exit(loop, lambda link=link: self._rank_exited(link))
                jobs += [(self._to_head(link, ch), f"rank {link.rank}'s {ch} relay") for ch in ("outputs", "status")]
            tasks = [asyncio.ensure_future(guarded(coro, self._task_failed, what)) for coro, what in jobs]
            await self._stop.wait()
        finally:
            await cancel_and_wait(tasks)
            await self._shutdown()
        return self.exit_code

    def _task_failed(self, reason: str) -> None:
        self.failure, self.exit_code = reason, 1
        self._stop.set()

    @property
    def ready(self) -> bool:
        """Every rank of this node has loaded (sent WorkerReady)."""
        return bool(self.links) and len(self._ready) == len(self.links)

    @property
    def healthy(self) -> bool:
        return self.ready and all(link.is_alive() for link in self.links.values())

    async def _join(self) -> str:
        """Say hello to the head until it answers (back-off), return the group's generation."""
        p = self.parallel
        hello = ENCODE(NodeHello(p.data_parallel_start_rank, p.local_size,
                                 config_digest(self.model_dir, self.config, p)))
        loop = asyncio.get_running_loop()
        deadline, wait = loop.time() + p.rendezvous_timeout_s, 0.5
        # One connection (ZeroMQ connects, and reconnects, in the background and queues the hello
        # until then); the hello is repeated with back-off until the head answers it.
        self.sock = heartbeat_socket(self.ctx.socket(zmq.DEALER), self.ring.payload_bytes + ENVELOPE_BYTES)
        self.auth.secure_client(self.sock, cluster_auth.NODE_CHANNEL)
        handshake = monitor_socket(self.sock, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.sock.connect(cluster_auth.tcp_endpoint(self.sock, p.data_parallel_address, p.data_parallel_rpc_port))
        try:
            while True:
                try:
                    await self.sock.send(hello, zmq.NOBLOCK)
                except zmq.Again:  # no connection to queue it on right now: the next round says it again
                    pass
                until = min(loop.time() + wait, deadline)
                while (left := until - loop.time()) > 0:
                    ready = dict(await self._poller(handshake).poll(timeout=max(1, int(left * 1000))))
                    if handshake in ready:
                        raise NodeError(f"the head at {p.data_parallel_address}:{p.data_parallel_rpc_port} refused "
                                        f"this node's handshake: the cluster keys differ, or only one side has one")
                    if self.sock not in ready:
                        break
                    try:
                        msg = DECODE(await self.sock.recv())
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    if isinstance(msg, NodeWelcome):
                        return msg.generation
                    if isinstance(msg, NodeRefused):
                        raise NodeError(f"the head refused this node: {msg.reason}")
                if loop.time() >= deadline:
                    raise NodeError(f"no head answered at {p.data_parallel_address}:{p.data_parallel_rpc_port} "
                                    f"within {p.rendezvous_timeout_s:g} s (this node runs ranks {list(p.local_ranks)})")
                wait = min(wait * 2, 5.0)
        finally:
            self.sock.disable_monitor()
            handshake.close(linger=0)

    def _poller(self, *others: zmq.Socket) -> zmq.asyncio.Poller:
        poller = zmq.asyncio.Poller()
        for sock in (self.sock, *others):
            poller.register(sock, zmq.POLLIN)
        return poller

    def _start_ranks(self, generation: str) -> None:
        p = self.parallel
        ring = self.ring
        for rank in p.local_ranks:
            def make_args(requests, control, outputs, status, rank=rank) -> WorkerArgs:
                return WorkerArgs(rank, self.model_dir, self.config.to_json().decode(), p.to_json().decode(),
                                  requests, control, outputs, status, self.threads, self.device,
                                  worker_device(self.device, rank - p.data_parallel_start_rank),
                                  p.data_parallel_rpc_port + 1, generation)

            self.links[rank] = LocalLink(rank, ring, make_args)

    async def _from_head(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 1:
                self.drops.drop("the head", "frames", f"{len(frames)} frames, 1 expected")
                continue
            try:
                msg = DECODE(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.drops.drop("the head", "undecodable", str(exc))
                continue
            link = self.links.get(getattr(msg, "rank", -1))
            if isinstance(msg, RankMessage) and link is not None and msg.channel in TO_RANK:
                await link.send(CHANNELS[msg.channel], msg.payload, timeout=3600.0)
            elif isinstance(msg, NodeBye):
                logger.warning("the head says: %s", msg.reason)
                self._stop.set()
                return
            elif not isinstance(msg, NodeWelcome):  # a welcome repeated for a repeated hello is harmless
                self.drops.drop("the head", "not_allowed", f"{type(msg).__name__} for rank {getattr(msg, 'rank', '-')}")

    async def _keep_alive(self) -> None:
        """Tell the head this node is up, whatever its ranks are doing (loading sends nothing)."""
        alive = ENCODE(NodeAlive())
        while True:
            await self.sock.send(alive)
            await asyncio.sleep(NODE_ALIVE_S)

    async def _to_head(self, link: LocalLink, channel: str) -> None:
        index = CHANNELS.index(channel)
        while True:
            try:
                data = await link.recv(channel, timeout=3600.0)
            except RingTimeout:
                continue
            except RingClosed:
                return
            except IpcError as exc:
                logger.error("rank %d %s ring failed: %s; stopping it", link.rank, channel, exc)
                link.kill()
                return
            if channel == "outputs" and link.rank not in self._ready:
                self._note_loading(link.rank, data)
            await self.sock.send(ENCODE(RankMessage(link.rank, index, data)))

    def _note_loading(self, rank: int, data: bytes) -> None:
        """Until a rank is ready, look at what it says (the head decodes everything else)."""
        try:
            msg = decode(data, "from_worker")
        except IpcError:
            return
        if isinstance(msg, WorkerReady):
            self._ready.add(rank)
            if self.ready:
                for callback in self.on_ready:
                    callback()
        elif isinstance(msg, Shutdown):
            self.failure = msg.reason

    async def _watch_head(self) -> None:
        """The head's connection closing (its process died, or ZeroMQ's heartbeats timed out)
        ends this node: its ranks belong to a group that no longer exists."""
        monitor = monitor_socket(self.sock, zmq.EVENT_DISCONNECTED)  # the second monitor of this socket
        try:
            await monitor.recv_multipart()
            logger.error("lost the head at %s:%d; stopping this node", self.parallel.data_parallel_address,
                         self.parallel.data_parallel_rpc_port)
            self.failure = self.failure or "lost the head"
            self.exit_code = 1
            self._stop.set()
        finally:
            self.sock.disable_monitor()
            monitor.close(linger=0)

    def _rank_exited(self, link: LocalLink) -> None:
        code = link.exitcode if link.exitcode is not None else -1
        logger.error("rank %d exited with %d; stopping this node", link.rank, code)
        reason = f"rank {link.rank} exited ({code})" + (f": {self.failure}" if self.failure else "")
        asyncio.ensure_future(self.sock.send(ENCODE(RankExited(link.rank, code, reason))))
        if not self._stop.is_set():
            self.exit_code = 1
        self._stop.set()

    async def _shutdown(self) -> None:
        from ipc import encode

        for link in self.links.values():
            link.unwatch_exit()
            if link.is_alive():
                try:
                    link.send_now("control", encode(Shutdown("node shutdown")), timeout=1.0)
                except IpcError:
                    pass
        await asyncio.gather(*(link.wait_exit(10.0) for link in self.links.values()))
        for link in self.links.values():
            link.close()
        if self.sock is not None:
            try:
                await asyncio.wait_for(self.sock.send(ENCODE(NodeBye("node stopped"))), 1.0)
            except (asyncio.TimeoutError, zmq.ZMQError):
                pass
            self.sock.close(linger=0)
        self.ctx.term()
