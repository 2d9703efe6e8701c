"""The per-device asyncio worker: accept and abort requests, step the engine, emit token deltas.

The loop never spins: with no work it awaits a wake-up event (set by `submit`/`abort`), so an
idle worker costs no CPU. A rank of an expert-parallel group instead agrees every step with the
others (engine/distributed/lockstep.py) and, when the whole group is idle, parks the same way until a
request or the engine client's `Wake` arrives. Between steps it yields to the event loop so new
requests and aborts land before the next schedule. After warm-up it freezes the GC generations (everything alive
then is long-lived) and runs full collections only while idle, so collection pauses stay out
of the token path (automatic oldest-generation collections are pushed far out). It records the
longest host-side pause between two consecutive steps and the longest GC pause inside them.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

import numba
import torch

from ipc.messages import INT64_MAX, Finished, Parked, SamplingParams, StepOutputs

from .core_share import CoreShare
from .distributed.lockstep import IDLE_PARK_S, Lockstep, StepPlan
from .engine import Engine
from .request import RequestError

logger = logging.getLogger(__name__)
WARMUP_REQUEST_ID = INT64_MAX  # never handed out by an engine client
MAX_EARLY_ABORTS = 65536  # remembered aborts of not-yet-seen ids (a few MB at most)


@dataclass
class WorkerStats:
    max_loop_pause_s: float = 0.0  # longest gap between two steps while work was waiting
    max_gc_pause_s: float = 0.0
    steps: int = 0


class Worker:
    def __init__(self, engine: Engine, emit: Callable[[StepOutputs | Parked], None], lockstep: Lockstep | None = None):
        self.engine = engine
        self.emit = emit
        self.lockstep = lockstep  # the expert-parallel group's agreement, or None (an independent rank)
        if lockstep is not None:  # every rank runs one forward per step: no multi-step calls, no lookahead blocks
            engine.scheduler.allow_decode_steps(1)
        self.stats = WorkerStats()
        self._commands: deque[tuple] = deque()
        # Aborts of ids this worker has not seen: aborts travel on their own ring, so one can
        # overtake its request's submission (queued behind others on the request ring). Such a
        # submission is then finished as aborted on arrival. Bounded (oldest forgotten first); ids
        # are never reused, so a stale entry (an abort after its request finished) is harmless.
        self._early_aborts: OrderedDict[int, None] = OrderedDict()
        self._wakeup: asyncio.Event | None = None
        self._woken_epoch = -1  # the newest idle agreement a Wake asked this rank to leave (lockstep)
        self._stopping = False
        self._gc_started = 0.0
        self._idle_collect = False
        self.step_started_at = 0.0  # wall-clock start of the step in progress (0 = idle); for the watchdog
        # [cpu] The thread count for the host's load (engine/core_share.py); None: not a CPU worker.
        self.core_share: CoreShare | None = None
        gc.callbacks.append(self._on_gc)

    # ---- commands (call from the worker's event loop thread) ------------------------------
    def submit(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
               kv_transfer_params=None, images=()) -> None:
        """`images`: the prompt's images (ipc.messages.ImageData, span order)."""
        self._commands.append(("submit", request_id, prompt_token_ids, params, kv_transfer_params, images))
        self.wake()

    def abort(self, request_ids: list[int]) -> None:
        self._commands.append(("abort", request_ids))
        self.wake()

    def stop(self) -> None:
        self._stopping = True
        self.wake()

    def wake(self, epoch: int | None = None) -> None:
        """Run the loop now: a command arrived, or (`epoch`: the engine client's `Wake`) the
        group parked after idle agreement `epoch` has work. Remembered if it comes before this
        rank parks there, so the rank then does not park at all."""
        if epoch is not None:
            self._woken_epoch = max(self._woken_epoch, epoch)
        if self._wakeup is not None:
            self._wakeup.set()

    def _apply_commands(self) -> None:
        finished: list[Finished] = []
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "submit":
                _, rid, ids, params, kv, images = cmd
                if rid in self._early_aborts:  # its abort came first
                    del self._early_aborts[rid]
                    finished.append(Finished(rid, "abort", len(ids), 0))
                    continue
                try:
                    self.engine.add_request(rid, ids, params, kv, images)
                except RequestError as exc:  # an invariant the edge should have enforced: refuse, don't crash
                    finished.append(Finished(rid, "error", len(ids), 0, str(exc), 400))
            else:
                for rid in cmd[1]:
                    done = self.engine.abort(rid)
                    if done is not None:
                        finished.append(done)
                    else:
                        self._early_aborts[rid] = None
                        if len(self._early_aborts) > MAX_EARLY_ABORTS:
                            self._early_aborts.popitem(last=False)
        if finished:
            self.emit(StepOutputs([], finished))

    # ---- the loop ------------------------------------------------------------------------
    def warm_up(self) -> None:
        """One tiny request through every path, then freeze what survives as permanent."""
        self.engine.add_request(WARMUP_REQUEST_ID, [self.engine.model.cfg.bos_token_id or 0],
                                SamplingParams(max_tokens=2, ignore_eos=True))
        while self.engine.has_work:
            self.engine.step()
        self._idle_collect = True
        gc.collect()
        self._idle_collect = False
        gc.freeze()
        # Young generations stay cheap and frequent; the oldest one only when idle (see run()), so
        # a full collection never lands in the token path. Nearly everything per step is acyclic
        # and freed by reference counting.
        gc.set_threshold(20_000, 50, 1_000_000)
        self.stats = WorkerStats()  # pauses are measured from serving on, not during loading

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.engine.on_grammar_ready = lambda: loop.call_soon_threadsafe(self.wake)  # from the compile thread
        if self.lockstep is not None:
            await self._run_lockstep(self.lockstep)
            return
        self._wakeup = asyncio.Event()
        last_step_end = None
        while not self._stopping:
            self._apply_commands()
            if self.engine.waits_on_grammars_only:  # nothing to step until a compile ends (it wakes us)
                self._wakeup.clear()
                failed = self.engine.settle_grammars()
                if failed:
                    self.emit(StepOutputs([], failed))
                elif self.engine.waits_on_grammars_only and not self._commands and not self._stopping:
                    await self._wakeup.wait()
                continue
            if not self.engine.has_work:
                last_step_end = None
                self._idle_collect = True
                gc.collect()  # idle: a full collection costs nobody anything now
                self._idle_collect = False
                self._wakeup.clear()
                if not self._commands and not self._stopping:
                    await self._idle_wait()
                continue
            start = time.perf_counter()
            if last_step_end is not None:
                self.stats.max_loop_pause_s = max(self.stats.max_loop_pause_s, start - last_step_end)
            self._fit_threads()
            self.step_started_at = time.time()
            out = self.engine.step()
            if out.deltas or out.finished:
                self.emit(out)
            self.step_started_at = 0.0
            self.stats.steps += 1
            last_step_end = time.perf_counter()
            await asyncio.sleep(0)  # let submits/aborts in before the next schedule

    def _fit_threads(self) -> None:
        """[cpu] Run the next step on as many threads as the host's load leaves this worker."""
        share = self.core_share
        if share is None:
            return
        before = share.current
        threads = share.threads()
        if threads != before:
            numba.set_num_threads(threads)
            torch.set_num_threads(threads)
            logger.info("%d compute threads (others keep %.2f of %d cores busy)", threads, share.others,
                        len(share.cpus))

    async def _idle_wait(self) -> None:
        """Wait for a command. [kv-connector] With a KV connector, tick it meanwhile: a prefill
        answers handshakes and lease renewals, a decode finishes its transfers."""
        connector = self.engine.connector
        if connector is None:
            await self._wakeup.wait()
            return
        while not self._wakeup.is_set() and not self.engine.has_work:
            out = self.engine.kv_tick()
            if out is not None:
                self.emit(out)
            if self.engine.has_work:
                return
            try:
                await asyncio.wait_for(self._wakeup.wait(), connector.poll_interval())
            except TimeoutError:
                pass

    async def _run_lockstep(self, lockstep: Lockstep) -> None:
        """The loop of one rank of an expert-parallel group: agree, then all step (or all idle)."""
        self._wakeup = asyncio.Event()
        engine = self.engine
        while True:
            self._apply_commands()
            loaded = engine.kv_tick()  # [kv-connector] transfers finished since the last iteration
            if loaded is not None:
                self.emit(loaded)
            if engine.grammars is not None:
                self._wakeup.clear()  # before looking: a compile ending from now on wakes us
                failed = engine.settle_grammars()
                if failed:
                    self.emit(StepOutputs([], failed))
                if engine.waits_on_grammars_only and not self._commands and not self._stopping:
                    # the group waits in its next agreement meanwhile (a compile is bounded: the
                    # edge compiled the same grammar within its time limit)
                    await self._wakeup.wait()
                    continue
            batch = engine.scheduler.schedule()
            wish = StepPlan(bool(batch), engine.draft_wish(batch) if batch else 0, engine.runner.static_ok(batch),
                            self._stopping)
            plan = lockstep.agree(wish)  # the one collective of every iteration, on every rank
            if plan.stopping:
                return
            if not plan.has_work:  # every rank is idle: park until work comes here or to a peer
                await self._park(lockstep.agreements)
                continue
            self._fit_threads()
            self.step_started_at = time.time()
            out = engine.run(batch, plan.num_drafts, allow_static=plan.static_ok, lockstep=True)
            if out.deltas or out.finished:
                self.emit(out)
            self.step_started_at = 0.0
            self.stats.steps += 1
            lockstep.after_step(self.stats.steps)
            await asyncio.sleep(0)

    async def _park(self, epoch: int) -> None:
        """Sleep after idle agreement `epoch` until a command or the client's Wake for this
        agreement (every rank of the group gets one, so all agree again together; an older,
        stale Wake is ignored). With a KV connector, wake every poll interval to tick it (its
        transfers may give this rank work)."""
        def woken() -> bool:
            return bool(self._commands) or self._stopping or self._woken_epoch >= epoch

        connector = self.engine.connector
        if connector is not None:
            self._wakeup.clear()
            if not woken():
                try:
                    await asyncio.wait_for(self._wakeup.wait(), min(IDLE_PARK_S, connector.poll_interval()))
                except TimeoutError:
                    pass
            return
        if not woken():
            self.emit(Parked(epoch))
        while not woken():
            self._wakeup.clear()
            await self._wakeup.wait()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started and not self._idle_collect:
            self.stats.max_gc_pause_s = max(self.stats.max_gc_pause_s, time.perf_counter() - self._gc_started)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
