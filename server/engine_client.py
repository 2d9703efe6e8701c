"""The server side of the workers: spawn one process per rank, own its two rings, route requests
by token load, stream each request's output to its caller, and notice a dead or stuck rank.

Per rank: a request ring (server writes Submit/Abort/Shutdown) and an output ring (the worker
writes TokenDelta/Finished/Error/Heartbeat). A listener task per rank decodes the output ring
into per-request queues. Process death is seen through the process sentinel (an fd the event
loop watches), within milliseconds, not through missing heartbeats; the dead rank's in-flight
requests fail with a clear error while the others keep running. A watchdog names a rank whose
step has run longer than `stuck_after_s`, with the step number and its duration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from engine.engine import EngineConfig
from ipc import (Abort, Error, Finished, Heartbeat, IpcError, RingConfig, RingReader, RingWriter, SamplingParamsMsg,
                 Shutdown, Submit, TokenDelta, WorkerReady, decode, encode)

from ipc.segment import remove_orphans

from .router import DPRouter

logger = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    pass


def _slot_bytes(max_model_len: int | None) -> int:
    """A ring slot must hold a Submit of the longest prompt (4 bytes a token) plus its header."""
    need = 4 * (max_model_len or 32768) + (64 << 10)
    return max(1 << 20, -(-need // 64) * 64)


@dataclass
class Output:
    """One item of a request's output stream."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_code: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class _Rank:
    index: int
    process: multiprocessing.Process
    requests: RingWriter
    outputs: RingReader
    ready: WorkerReady | None = None
    alive: bool = True
    last_beat: Heartbeat | None = None
    inflight: set[int] = field(default_factory=set)


class EngineClient:
    def __init__(self, model_dir: str | Path, config: EngineConfig, dp: int = 1, device: str = "cpu",
                 threads_per_worker: int | None = None, ring_config: RingConfig | None = None,
                 stuck_after_s: float = 30.0, ready_timeout_s: float = 600.0, routing: str = "token_load"):
        self.model_dir, self.config, self.dp, self.device = str(model_dir), config, dp, device
        self.threads = threads_per_worker or max(1, (os.cpu_count() or 1) // dp)
        self.ring_config = ring_config or RingConfig(slot_bytes=_slot_bytes(config.max_model_len), num_slots=64)
        self.stuck_after_s = stuck_after_s
        self.ready_timeout_s = ready_timeout_s
        self.ranks: list[_Rank] = []
        self.router = DPRouter(dp, config.block_size, policy=routing)
        self._queues: dict[int, asyncio.Queue] = {}
        self._owner: dict[int, int] = {}
        self._next_id = 1
        self._tasks: list[asyncio.Task] = []
        self.on_dead: list = []  # callbacks(rank) fired when a worker dies
        self.stuck: dict[int, str] = {}  # rank → what the watchdog last reported

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        remove_orphans()  # rings a crashed predecessor left in /dev/shm
        ctx = multiprocessing.get_context("spawn")
        from server.worker_entry import run_worker

        config_json = json.dumps(self.config.to_dict())
        for rank in range(self.dp):
            requests = RingWriter.create(self.ring_config)
            outputs = RingReader.create(self.ring_config)
            proc = ctx.Process(target=run_worker, name=f"ringserve-rank{rank}", daemon=True,
                               args=(rank, self.model_dir, config_json, requests.name, outputs.name, self.threads,
                                     self.device))
            proc.start()
            self.ranks.append(_Rank(rank, proc, requests, outputs))
        try:
            await asyncio.gather(*(self._await_ready(r) for r in self.ranks))
        except BaseException:
            await self.shutdown(timeout_s=5.0)  # no half-started server: stop every rank, unlink rings
            raise
        loop = asyncio.get_running_loop()
        for r in self.ranks:
            loop.add_reader(r.process.sentinel, self._on_sentinel, r)
            self._tasks.append(asyncio.ensure_future(self._listen(r)))
        self._tasks.append(asyncio.ensure_future(self._watchdog()))

    async def _await_ready(self, r: _Rank) -> None:
        """Wait for WorkerReady; a worker that fails to load reports why (Shutdown) before exiting."""
        deadline = time.monotonic() + self.ready_timeout_s
        while r.ready is None:
            alive = r.process.is_alive()  # read before polling, so a last message is never missed
            try:
                data = r.outputs.poll()
            except IpcError:
                data = None
            if data is not None:
                msg = decode(data)
                if isinstance(msg, WorkerReady):
                    r.ready = msg
                elif isinstance(msg, Shutdown):
                    raise WorkerDied(msg.reason)
                continue
            if not alive:
                raise WorkerDied(f"rank {r.index} exited with code {r.process.exitcode} while loading")
            if time.monotonic() > deadline:
                raise WorkerDied(f"rank {r.index} not ready after {self.ready_timeout_s:.0f} s")
            await asyncio.sleep(0.02)

    @property
    def max_model_len(self) -> int:
        return min(r.ready.max_model_len for r in self.ranks if r.ready)

    @property
    def healthy(self) -> bool:
        return bool(self.ranks) and all(r.alive for r in self.ranks)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for r in self.ranks:
            loop.remove_reader(r.process.sentinel)
            if r.alive and r.process.is_alive():
                try:
                    r.requests.put(encode(Shutdown("server shutdown")), timeout=1.0)
                except IpcError:
                    pass
        deadline = time.monotonic() + timeout_s
        for r in self.ranks:
            while r.process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if r.process.is_alive():
                r.process.kill()
            r.process.join(timeout=5)
            r.alive = False  # nothing more is sent to it (aborts of cancelled requests included)
            r.requests.close()
            r.outputs.close()
        for q in self._queues.values():
            q.put_nowait(Output(finish_reason="abort", error="server shutting down", error_code=503))

    # ---- requests --------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParamsMsg,
                       request_id: int | None = None) -> AsyncIterator[Output]:
        """Submit a request and yield its output as it arrives, ending with a finish item.
        Cancelling the iteration aborts the request in its worker."""
        rid = self.new_request_id() if request_id is None else request_id
        rank = self.router.assign(rid, len(prompt_token_ids), params.max_tokens, params.session_id)
        r = self.ranks[rank]
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._owner[rid] = rank
        r.inflight.add(rid)
        finished = False
        try:
            await r.requests.put_async(encode(Submit(rid, list(prompt_token_ids), params),
                                              max_bytes=r.requests.capacity), timeout=30.0)
            while True:
                item: Output = await queue.get()
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(rid)
            self._forget(rid)

    def new_request_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    async def abort(self, request_id: int) -> None:
        rank = self._owner.get(request_id)
        if rank is None or not self.ranks[rank].alive:
            return
        try:
            await self.ranks[rank].requests.put_async(encode(Abort(request_id)), timeout=5.0)
        except IpcError as exc:
            logger.warning("abort of request %d on rank %d failed: %s", request_id, rank, exc)

    def _forget(self, rid: int) -> None:
        rank = self._owner.pop(rid, None)
        self._queues.pop(rid, None)
        if rank is not None:
            self.ranks[rank].inflight.discard(rid)
        self.router.on_finish(rid)

    # ---- output side -----------------------------------------------------------------------
    async def _listen(self, r: _Rank) -> None:
        pending_error: dict[int, Error] = {}
        while r.alive:
            try:
                msg = decode(await r.outputs.get_async(timeout=3600.0))
            except asyncio.CancelledError:
                raise
            except IpcError as exc:
                if r.alive and r.process.is_alive():
                    logger.error("rank %d output ring failed: %s", r.index, exc)
                return
            if isinstance(msg, Heartbeat):
                r.last_beat = msg
                self.router.on_heartbeat(r.index, msg.kv_blocks_used)
            elif isinstance(msg, TokenDelta):
                self.router.on_tokens(msg.request_id, len(msg.token_ids))
                self._deliver(msg.request_id, Output(list(msg.token_ids), msg.logprobs, msg.top_logprobs))
            elif isinstance(msg, Error):
                pending_error[msg.request_id] = msg
            elif isinstance(msg, Finished):
                err = pending_error.pop(msg.request_id, None)
                self.router.on_finish(msg.request_id, msg.completion_tokens)
                self._deliver(msg.request_id, Output(finish_reason=msg.reason, error=err.message if err else None,
                                                     error_code=err.code if err else 0,
                                                     prompt_tokens=msg.prompt_tokens,
                                                     completion_tokens=msg.completion_tokens))
            elif isinstance(msg, Shutdown):
                logger.warning("rank %d: %s", r.index, msg.reason)

    def _deliver(self, rid: int, item: Output) -> None:
        queue = self._queues.get(rid)
        if queue is not None:
            queue.put_nowait(item)

    def _on_sentinel(self, r: _Rank) -> None:
        asyncio.get_running_loop().remove_reader(r.process.sentinel)
        if not r.alive:
            return
        r.alive = False
        r.process.join(timeout=1)
        reason = f"worker rank {r.index} died (exit code {r.process.exitcode})"
        logger.error("%s; failing its %d in-flight requests", reason, len(r.inflight))
        for rid in self.router.mark_dead(r.index) + list(r.inflight):
            self._deliver(rid, Output(finish_reason="error", error=reason, error_code=503))
        r.inflight.clear()
        for callback in self.on_dead:
            callback(r.index)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.time()
            for r in self.ranks:
                beat = r.last_beat
                if not r.alive or beat is None:
                    continue
                stale = now - beat.sent_at
                if stale <= self.stuck_after_s:
                    self.stuck.pop(r.index, None)
                    continue
                # Heartbeats go out between steps, so silence means one step is running that long.
                what = (f"rank {r.index} stuck: no heartbeat for {stale:.1f} s; step {beat.step + 1} has been "
                        f"running at least that long ({beat.num_running} running, {beat.num_waiting} waiting, "
                        f"{beat.kv_blocks_used}/{beat.kv_blocks_total} KV blocks)")
                if self.stuck.get(r.index) is None:
                    logger.error("watchdog: %s", what)
                self.stuck[r.index] = what
