"""The one client of the worker processes, used by the HTTP server, `ringserve generate` and the
offline `LLM`: spawn one process per rank, own its rings, route requests by token load, stream
each request's output to its caller, and notice a dead or stuck rank.

Per rank: a request ring (Submit), a control ring (Abort, Shutdown), an output ring
(WorkerReady, StepOutputs, Shutdown) and a status ring (Heartbeat, from a worker thread). Aborts
are queued per rank and flushed by one task in batches, so a cancellation is never dropped, even
while the control ring is full. A listener task per rank decodes the output ring into
per-request queues of `TokenDelta` and `Finished` (the wire messages themselves).

Failures are loud. Process death is seen through the process sentinel (an fd the event loop
watches) within milliseconds; the dead rank's in-flight requests end with an error naming the
cause (what the worker reported before exiting, if anything) while the others keep running. A
ring this process reads that fails (a corrupt slot, a message that does not decode) takes its
rank down the same way: the worker is killed, never resumed. The watchdog names a rank whose
heartbeats stopped (a stopped process, or one that holds the GIL) after `liveness_timeout_s`,
and one whose step has made no progress (no layer ran) for `stuck_after_s`; either makes the
client unhealthy until the rank recovers.

This module never imports torch: the HTTP process stays light (see docs/lifecycle.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Union

from engine.config import EngineConfig, ParallelConfig
from ipc import (Abort, Finished, Heartbeat, IpcError, RingClosed, RingConfig, RingTimeout, SamplingParams, Shutdown,
                 StepOutputs, Submit, TokenDelta, Wake, WorkerReady, decode, encode)
from ipc.messages import ImageData, Parked
from ipc.segment import remove_orphans

from ipc.channel_guard import cancel_and_wait
from .links import LocalLink, NodeChannel, RankLink
from .router import DPRouter, NoRankAlive
from .worker_entry import WorkerArgs

logger = logging.getLogger(__name__)

Output = Union[TokenDelta, Finished]  # what a request's stream yields; it ends with one Finished


class WorkerDied(RuntimeError):
    pass


REQUEST_RING_BYTES = 512 << 20  # a request ring's slots shrink in number, not below 8, to stay within this


def request_ring(max_model_len: int | None, image_bytes: int = 0) -> RingConfig:
    """A request-ring slot must hold a Submit of the longest prompt (≤ 5 bytes a token), its
    images' pixels (`image_bytes`: the per-prompt image limit × the largest image the model's
    token budget allows) and its header. Rings with large slots get fewer of them."""
    need = 5 * (max_model_len or 32768) + image_bytes + (64 << 10)
    slot = max(1 << 20, -(-need // 64) * 64)
    return RingConfig(slot_bytes=slot, num_slots=max(8, min(64, REQUEST_RING_BYTES // slot)))


@dataclass
class _Rank:
    index: int
    link: RankLink
    ready: WorkerReady | None = None
    alive: bool = True
    last_beat: Heartbeat | None = None
    beat_seen_at: float = 0.0  # monotonic time the last heartbeat arrived
    progress_seen_at: float = 0.0  # monotonic time its progress counter last moved
    failure: str | None = None  # why the rank went down, as the worker or a failing ring said
    inflight: set[int] = field(default_factory=set)
    # Submitted and not yet seen finished by the output listener (it runs ahead of `inflight`,
    # which a request leaves once its consumer has read its end).
    unfinished: set[int] = field(default_factory=set)
    parked: int | None = None  # expert parallelism: the idle agreement the rank reported parking at
    aborts: list[int] = field(default_factory=list)  # waiting for the abort flusher
    abort_wakeup: asyncio.Event = field(default_factory=asyncio.Event)


class EngineClient:
    def __init__(self, model_dir: str | Path, config: EngineConfig, dp: int | None = None, device: str = "cpu",
                 threads_per_worker: int | None = None, ring_config: RingConfig | None = None,
                 stuck_after_s: float = 60.0, liveness_timeout_s: float = 5.0, ready_timeout_s: float = 600.0,
                 routing: str = "token_load", parallel: ParallelConfig | None = None, image_bytes: int = 0):
        if dp is not None and dp < 1:
            raise ValueError(f"--dp must be ≥ 1, got {dp}")
        self.parallel = parallel or ParallelConfig(data_parallel_size=dp or 1)
        dp = self.parallel.data_parallel_size
        self.model_dir, self.config, self.dp, self.device = str(model_dir), config, dp, device
        self.threads = threads_per_worker or max(1, (os.cpu_count() or 1) // self.parallel.local_size)
        self.ring_config = ring_config or request_ring(config.max_model_len, image_bytes)
        # Outputs carry no images: their ring keeps the text-only size (None: as the requests').
        self.output_ring = request_ring(config.max_model_len) if image_bytes and ring_config is None else None
        self.stuck_after_s = stuck_after_s
        self.liveness_timeout_s = liveness_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.ranks: list[_Rank] = []
        self.router = DPRouter(dp, config.block_size, policy=routing)
        self._queues: dict[int, asyncio.Queue] = {}
        self._owner: dict[int, int] = {}
        self._next_id = 1
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()  # wake-ups sent from the output listeners
        self.on_dead: list = []  # callbacks(rank) fired when a worker dies
        self.stuck: dict[int, str] = {}  # rank → what the watchdog last reported
        self._shut_down = False
        self._nodes: NodeChannel | None = None  # a multi-node head's channel to its headless nodes

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Start this node's ranks (and, on a multi-node head, welcome the headless nodes'), wait
        until every rank is ready, then listen. Anything half-started is stopped on failure."""
        remove_orphans()  # rings a crashed predecessor left in /dev/shm
        parallel = self.parallel
        # One rendezvous per start: a fresh generation id, so a restarted group never meets a
        # stale peer; on one node the store takes any free port, across nodes the agreed one.
        generation = uuid.uuid4().hex
        try:
            if parallel.multi_node:
                self._nodes = NodeChannel(parallel.data_parallel_address, parallel.data_parallel_rpc_port)
            self.start_local_ranks(generation)
            if self._nodes is not None:
                remote = [(first, n) for first, n in remote_nodes(parallel)]
                links = await self._nodes.accept(remote, config_digest(self.model_dir, self.config, parallel),
                                                 generation, self.ring_config.payload_bytes,
                                                 parallel.rendezvous_timeout_s)
                self.ranks += [_Rank(link.rank, link) for link in links]
                self.ranks.sort(key=lambda r: r.index)
            await asyncio.gather(*(self._await_ready(r) for r in self.ranks))
        except BaseException:
            await self.shutdown(timeout_s=5.0)  # no half-started server: stop every rank, unlink rings
            raise
        self.listen()

    def start_local_ranks(self, generation: str) -> None:
        parallel = self.parallel
        master_port = 0
        if parallel.grouped:
            from engine.distributed.group import pick_free_port

            master_port = (parallel.data_parallel_rpc_port + 1 if parallel.multi_node
                           else pick_free_port(parallel.data_parallel_address))
        for rank in parallel.local_ranks:
            def make_args(requests, control, outputs, status, rank=rank) -> WorkerArgs:
                return WorkerArgs(rank, self.model_dir, self.config.to_json().decode(), parallel.to_json().decode(),
                                  requests, control, outputs, status, self.threads, self.device,
                                  worker_device(self.device, rank - parallel.data_parallel_start_rank), master_port,
                                  generation)

            self.ranks.append(_Rank(rank, LocalLink(rank, self.ring_config, make_args, self.output_ring)))

    def listen(self) -> None:
        """Start the tasks that drain every rank's channels and watch them."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        for r in self.ranks:
            r.beat_seen_at = r.progress_seen_at = now
            r.link.watch_exit(loop, lambda r=r: self._on_exit(r))
            self._tasks += [asyncio.ensure_future(coro) for coro in
                            (self._listen(r), self._listen_status(r), self._flush_aborts(r))]
        self._tasks.append(asyncio.ensure_future(self._watchdog()))

    async def _await_ready(self, r: _Rank) -> None:
        """Wait for WorkerReady; a worker that fails to load reports why (Shutdown) before exiting."""
        deadline = time.monotonic() + self.ready_timeout_s
        while r.ready is None:
            alive = r.link.is_alive()  # read before polling, so a last message is never missed
            try:
                data = r.link.poll("outputs")
            except IpcError:
                data = None
            if data is not None:
                msg = decode(data, "from_worker")
                if isinstance(msg, WorkerReady):
                    r.ready = msg
                elif isinstance(msg, Shutdown):
                    raise WorkerDied(msg.reason)
                continue
            if not alive:
                raise WorkerDied(getattr(r.link, "reason", "") or
                                 f"rank {r.index} exited with code {r.link.exitcode} while loading")
            if time.monotonic() > deadline:
                raise WorkerDied(f"rank {r.index} not ready after {self.ready_timeout_s:.0f} s")
            await asyncio.sleep(0.02)

    @property
    def max_model_len(self) -> int:
        return min(r.ready.max_model_len for r in self.ranks if r.ready)

    @property
    def healthy(self) -> bool:
        """Every rank alive and answering (not stopped, not stuck)."""
        return bool(self.ranks) and all(r.alive for r in self.ranks) and not self.stuck

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every rank and unlink every ring (idempotent)."""
        if self._shut_down:
            return
        self._shut_down = True
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        for r in self.ranks:
            r.link.unwatch_exit()  # the exits we ask for now are not failures
            if r.alive and isinstance(r.link, LocalLink) and r.link.is_alive():
                try:
                    r.link.send_now("control", encode(Shutdown("server shutdown")), timeout=1.0)
                except IpcError:
                    pass
        waits = [r.link.wait_exit(timeout_s) for r in self.ranks if isinstance(r.link, LocalLink)]
        if self._nodes is not None:  # each headless node stops its own ranks
            waits.append(self._nodes.say_bye("server shutdown", timeout_s))
        await asyncio.gather(*waits)
        for r in self.ranks:
            r.alive = False  # nothing more is sent to it (aborts of cancelled requests included)
            r.link.close()
        if self._nodes is not None:
            await self._nodes.close()
        for rid in list(self._queues):
            self._deliver(rid, Finished(rid, "abort", 0, 0, "server shutting down", 503))

    # ---- requests --------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: int | None = None,
                       session: str | None = None, kv_transfer_params=None,
                       images: list[ImageData] | None = None) -> AsyncIterator[Output]:
        """Submit a request and yield its output as it arrives, ending with its `Finished`.
        Cancelling the iteration aborts the request in its worker. `kv_transfer_params`: a leg
        of a PD-disaggregated request (ipc.kv_transfer_params.KVTransferParams); `images`:
        its preprocessed images (DeepSeek-V4.1, span starts in the expanded prompt)."""
        rid = self.new_request_id() if request_id is None else request_id
        try:
            rank = self.router.assign(rid, len(prompt_token_ids), params.max_tokens, session)
        except NoRankAlive as exc:
            yield Finished(rid, "error", len(prompt_token_ids), 0, str(exc), 503)
            return
        r = self.ranks[rank]
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._owner[rid] = rank
        r.inflight.add(rid)
        r.unfinished.add(rid)
        finished = False
        try:
            submit = Submit(rid, prompt_token_ids, params, kv_transfer_params, images or [])
            await r.link.send("requests", encode(submit, max_bytes=r.link.capacity("requests")), timeout=30.0)
            r.parked = None  # the submission wakes it
            if self.parallel.grouped and any(x.parked is not None for x in self.ranks):
                await self._wake_group(max(x.parked for x in self.ranks if x.parked is not None), r)
            while True:
                item: Output = await queue.get()
                finished = isinstance(item, Finished)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)
            self._forget(rid)

    async def _wake_group(self, epoch: int, busy: _Rank | None = None) -> None:
        """Expert parallelism: the group parked after idle agreement `epoch` has work (a request
        for `busy`, or one that raced the group going idle): wake every rank but `busy` (its
        request wakes it), so all of them join the next agreement together."""
        wake = encode(Wake(epoch))
        for x in self.ranks:
            x.parked = None
            if x is not busy and x.alive:
                try:
                    await x.link.send("control", wake, timeout=1.0)
                except IpcError as exc:  # a control ring that stays full: the rank is stuck anyway
                    logger.warning("rank %d: could not wake it from its park (%s)", x.index, exc)

    def _on_parked(self, r: _Rank, epoch: int) -> None:
        """A rank parked after idle agreement `epoch`. With requests in flight the group has
        work (a submission raced the idle agreement; or their ends are still on their way, and
        the group then agrees once more and parks again): wake it all now."""
        if any(x.unfinished for x in self.ranks):
            task = asyncio.ensure_future(self._wake_group(epoch))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        else:
            r.parked = epoch

    def new_request_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def abort(self, request_id: int) -> None:
        """Queue an abort for the request's rank; the rank's flusher delivers it (never dropped)."""
        rank = self._owner.get(request_id)
        if rank is None or not self.ranks[rank].alive:
            return
        r = self.ranks[rank]
        r.aborts.append(request_id)
        r.abort_wakeup.set()

    async def _flush_aborts(self, r: _Rank) -> None:
        """Write queued aborts to the rank's control ring, as many per message as are waiting."""
        while r.alive:
            await r.abort_wakeup.wait()
            r.abort_wakeup.clear()
            while r.aborts and r.alive:
                batch, r.aborts = r.aborts[:4096], r.aborts[4096:]
                try:
                    await r.link.send("control", encode(Abort(batch)), timeout=3600.0)
                except IpcError as exc:
                    if r.alive:
                        logger.error("rank %d control ring failed: %s", r.index, exc)
                    return

    def _forget(self, rid: int) -> None:
        rank = self._owner.pop(rid, None)
        self._queues.pop(rid, None)
        if rank is not None:
            self.ranks[rank].inflight.discard(rid)
            self.ranks[rank].unfinished.discard(rid)
        self.router.on_finish(rid)

    # ---- output side -----------------------------------------------------------------------
    async def _listen(self, r: _Rank) -> None:
        while r.alive:
            try:
                msg = decode(await r.link.recv("outputs", timeout=3600.0), "from_worker")
            except asyncio.CancelledError:
                raise
            except (RingTimeout, TimeoutError):
                continue
            except RingClosed:  # the worker closed its end: it is exiting, its sentinel says how
                return
            except IpcError as exc:
                self._ring_failed(r, "output ring", exc)
                return
            if isinstance(msg, StepOutputs):
                r.parked = None
                for delta in msg.deltas:
                    self.router.on_tokens(delta.request_id, len(delta.token_ids))
                    self._deliver(delta.request_id, delta)
                for done in msg.finished:
                    r.unfinished.discard(done.request_id)
                    self.router.on_finish(done.request_id, done.completion_tokens)
                    self._deliver(done.request_id, done)
            elif isinstance(msg, Parked):
                self._on_parked(r, msg.epoch)
            elif isinstance(msg, Shutdown):
                r.failure = msg.reason  # a worker says why before it exits
                logger.warning("rank %d: %s", r.index, msg.reason)

    async def _listen_status(self, r: _Rank) -> None:
        while r.alive:
            try:
                beat = decode(await r.link.recv("status", timeout=3600.0), "from_worker")
            except asyncio.CancelledError:
                raise
            except (RingTimeout, TimeoutError):
                continue
            except RingClosed:
                return
            except IpcError as exc:
                self._ring_failed(r, "status ring", exc)
                return
            if not isinstance(beat, Heartbeat):
                continue
            now = time.monotonic()
            last = r.last_beat
            if last is None or not beat.step_started_at or (beat.progress, beat.step) != (last.progress, last.step):
                r.progress_seen_at = now
            r.last_beat, r.beat_seen_at = beat, now
            self.router.on_heartbeat(r.index, beat.kv_blocks_used)

    def _ring_failed(self, r: _Rank, ring: str, exc: BaseException) -> None:
        """A ring from this rank failed: the rank cannot be trusted again. Kill it; the sentinel
        then fails its requests with this reason (unless it already died for its own)."""
        if not r.alive or not r.link.is_alive():
            return
        r.failure = r.failure or f"rank {r.index} {ring} failed: {type(exc).__name__}: {exc}"
        logger.error("%s; stopping the rank", r.failure)
        r.link.kill()

    def _deliver(self, rid: int, item: Output) -> None:
        queue = self._queues.get(rid)
        if queue is not None:
            queue.put_nowait(item)

    def _on_exit(self, r: _Rank) -> None:
        if not r.alive:
            return
        r.alive = False
        r.abort_wakeup.set()
        died = f"worker rank {r.index} died (exit code {r.link.exitcode})"
        reported = r.failure or getattr(r.link, "reason", "")
        reason = f"{died}: {reported}" if reported else died
        # An expert-parallel group cannot heal: every rank's requests fail now, with this cause.
        victims = [x for x in self.ranks if x.alive or x is r] if self.parallel.grouped else [r]
        if self.parallel.grouped:
            reason += "; the expert-parallel group cannot continue"
        lost = [rid for x in victims for rid in self.router.mark_dead(x.index) + list(x.inflight)]
        logger.error("%s; failing its %d in-flight requests", reason, len(lost))
        for rid in lost:
            self._deliver(rid, Finished(rid, "error", 0, 0, reason, 503))
        for x in victims:
            x.inflight.clear()
        for callback in self.on_dead:
            callback(r.index)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.liveness_timeout_s / 4))
            now = time.monotonic()
            for r in self.ranks:
                verdict = watchdog_verdict(r.index, r.last_beat, now - r.beat_seen_at, now - r.progress_seen_at,
                                           self.liveness_timeout_s, self.stuck_after_s) if r.alive else None
                if verdict is None:
                    if self.stuck.pop(r.index, None) is not None:
                        logger.warning("watchdog: rank %d answers again", r.index)
                    continue
                if self.stuck.get(r.index) is None:
                    logger.error("watchdog: %s", verdict)
                self.stuck[r.index] = verdict


def watchdog_verdict(rank: int, beat: Heartbeat | None, silent_s: float, stalled_s: float, liveness_timeout_s: float,
                     stuck_after_s: float) -> str | None:
    """Why rank `rank` is not answering, or None if it is. `silent_s`: seconds since its last
    heartbeat; `stalled_s`: seconds since its progress counter last moved (while a step runs)."""
    if silent_s > liveness_timeout_s:
        if beat is None:
            where = "it had sent none"
        elif beat.step_started_at:
            where = f"step {beat.step + 1} was running ({beat.num_running} running, {beat.num_waiting} waiting)"
        else:
            where = f"it was idle after step {beat.step}"
        return (f"rank {rank} stuck: no heartbeat for {silent_s:.1f} s (the process is stopped, or holds the GIL); "
                f"{where}")
    if beat is not None and beat.step_started_at and stalled_s > stuck_after_s:
        return (f"rank {rank} stuck: step {beat.step + 1} has run no layer for {stalled_s:.1f} s "
                f"({beat.num_running} running, {beat.num_waiting} waiting, "
                f"{beat.kv_blocks_used}/{beat.kv_blocks_total} KV blocks)")
    return None


def remote_nodes(parallel: ParallelConfig) -> list[tuple[int, int]]:
    """(first rank, ranks) of every other node, when each runs as many ranks as the head."""
    n, local = parallel.data_parallel_size, parallel.local_size
    if n % local:
        raise ValueError(f"--data-parallel-size {n} is not a multiple of --data-parallel-size-local {local}")
    return [(first, local) for first in range(local, n, local)]


def config_digest(model_dir: str, config: EngineConfig, parallel: ParallelConfig) -> str:
    """What every node of a multi-node group must agree on: the model's configuration, the
    engine's, and the group's geometry (node-local fields left out)."""
    from engine.config import ModelConfig

    group = dataclasses.replace(parallel, data_parallel_start_rank=0, headless=False)
    text = b"|".join([repr(ModelConfig.from_model_dir(model_dir)).encode(), config.to_json(), group.to_json()])
    return hashlib.sha256(text).hexdigest()


def worker_device(device: str, rank: int) -> str | None:
    """The accelerator a rank's process may see (`CUDA_VISIBLE_DEVICES` for it), or None on CPU.
    Rank r takes the r-th device of what this process may see (its own CUDA_VISIBLE_DEVICES, if
    set, else all), so with --dp N each rank owns its own GPU and addresses it as cuda:0."""
    if not device.startswith("cuda"):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    if devices is None:
        return str(rank)
    if rank >= len(devices):
        raise ValueError(f"--dp needs {rank + 1} GPUs but CUDA_VISIBLE_DEVICES lists {len(devices)}")
    return devices[rank]
