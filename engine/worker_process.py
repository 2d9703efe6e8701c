"""Entry point of a worker process: one engine, fed and drained through shared-memory rings.

The server creates (and owns) four rings per worker and starts this process with their names:
requests (Submit), control (Abort, Shutdown: a path that submissions can never fill, so a
cancellation is never starved), outputs (WorkerReady, StepOutputs, Shutdown) and status
(Heartbeat, written by a thread of its own every 250 ms, so heartbeats keep coming during a
long step and stop only when the process does). The worker attaches, loads the model, warms
up, announces `WorkerReady`, then runs the asyncio worker. Every message is codec bytes; nothing
is pickled.

A ring that fails (a corrupt slot, a peer that died, a message that does not decode) is never
papered over: the worker reports the cause in a `Shutdown` and exits non-zero, so the server
fails this rank's requests with that reason and the supervisor restarts the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import torch

from ipc import (Abort, Heartbeat, IpcError, RingReader, RingTimeout, RingWriter, Shutdown, StepOutputs, Submit,
                 Wake, WorkerReady, decode, encode)
from ipc.errors import MessageTooLarge
from ipc.loop import new_event_loop
from kernels import cpu_precision

from .config import ConfigError, EngineConfig, ModelConfig, ParallelConfig
from .core_share import CoreShare
from .distributed.expert_parallel import ExpertParallel, experts_to_load, initial_placement
from .distributed.group import RendezvousError
from .distributed.lockstep import Lockstep, join_group
from .engine import Engine, default_dtype
from .kv_connector import attach_connector
from .models import registry
from .weights import WeightLoadError, load_model
from .worker import Worker

logger = logging.getLogger(__name__)
HEARTBEAT_S = 0.25


class RingFailure(RuntimeError):
    """A ring this worker reads or writes failed; the message names the ring and the cause."""


class Outbox:
    """Encodes the worker's messages into its output ring. A step's outputs go as one message,
    split only if they would not fit one slot."""

    def __init__(self, writer: RingWriter):
        self.writer = writer

    def send(self, msg) -> None:
        try:
            self.writer.put(encode(msg, max_bytes=self.writer.capacity), timeout=60.0)
        except MessageTooLarge:
            if not isinstance(msg, StepOutputs) or len(msg.deltas) + len(msg.finished) < 2:
                raise
            half = len(msg.deltas) // 2
            if half:
                self.send(StepOutputs(msg.deltas[:half], []))
                self.send(StepOutputs(msg.deltas[half:], msg.finished))
            else:
                half = len(msg.finished) // 2
                self.send(StepOutputs(msg.deltas, msg.finished[:half]))
                self.send(StepOutputs([], msg.finished[half:]))
        except IpcError as exc:
            raise RingFailure(f"output ring: {type(exc).__name__}: {exc}") from None


def worker_main(args, device: str = "cpu") -> None:
    """Run one rank until told to stop (args: server.worker_entry.WorkerArgs)."""
    rank = args.rank
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.num_threads)
    writer = RingWriter.attach(args.output_ring)
    requests = RingReader.attach(args.request_ring)
    control = RingReader.attach(args.control_ring)
    status = RingWriter.attach(args.status_ring)
    outbox = Outbox(writer)
    heartbeat: HeartbeatThread | None = None
    group = None
    engine = None
    try:
        config = EngineConfig.from_json(args.engine_config)
        parallel = ParallelConfig.from_json(args.parallel_config)
        if parallel.grouped:
            group = join_group(rank, parallel, args.master_port, args.generation)
        model, ep = _load(args.model_dir, config, parallel, device, group)
        if device == "cpu":  # before the engine's warm-up steps
            cpu_precision.apply(config.cpu_matmul_precision, config.dtype,
                                reference_numerics=registry.of(model.cfg).capabilities.reference_numerics)
        engine = Engine(model, config)
        attach_connector(engine, rank)  # [kv-connector] --kv-transfer: NIXL agent, pools registered
        worker = Worker(engine, outbox.send, Lockstep(group, ep, parallel) if group is not None else None)
        if device == "cpu":
            # Batch-invariant numerics keep one thread count: the decode kernels' bits do not
            # depend on it, but torch's CPU GEMMs (prefill) promise nothing there
            worker.core_share = CoreShare(args.num_threads, adapt=not config.batch_invariant)
        worker.warm_up()
        heartbeat = HeartbeatThread(rank, worker, status)
        heartbeat.start()
        outbox.send(WorkerReady(rank, os.getpid(), engine.cache.manager.full.num_blocks, engine.config.block_size,
                                engine.max_model_len, device))
        loop = new_event_loop()
        try:
            loop.run_until_complete(_serve(rank, worker, requests, control, outbox, heartbeat))
        finally:
            loop.close()
    except Exception as exc:  # report, then exit non-zero: the server fails this rank's requests
        if not isinstance(exc, (ConfigError, WeightLoadError, RingFailure, RendezvousError)):  # known: one line
            logger.exception("worker %d failed", rank)
        try:
            outbox.send(Shutdown(f"rank {rank} failed: {type(exc).__name__}: {exc}"))
        except Exception:  # noqa: BLE001 - the output ring itself may be what failed
            pass
        raise SystemExit(1)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if engine is not None and engine.connector is not None:  # [kv-connector] leases, loads, NIXL agent
            engine.connector.close()
        if group is not None:
            group.close()
        requests.close()
        control.close()
        writer.close()
        status.close()


def _load(model_dir: str, config: EngineConfig, parallel: ParallelConfig, device: str, group):
    """The model, with this rank's share of the experts under expert parallelism (and the
    machinery that reaches the others' shares), else whole."""
    resolved = config.resolved()
    load_mtp = bool(resolved.speculative_tokens)
    kwargs = dict(dtype=default_dtype(config, device), device=device, progress=False, load_mtp=load_mtp,
                  weight_dtype=config.weight_dtype, engram_tables=config.engram_tables,
                  language_model_only=config.language_model_only)
    if group is None:
        return load_model(model_dir, **kwargs), None
    cfg = ModelConfig.from_model_dir(model_dir)
    num_mtp = cfg.num_nextn_predict_layers if load_mtp else 0
    placement = initial_placement(cfg, num_mtp, parallel)
    model = load_model(model_dir, experts=experts_to_load(placement, group.rank), **kwargs)
    if len(model.mtp) != num_mtp:
        raise ConfigError("--speculative-tokens needs MTP weights in the checkpoint")
    return model, ExpertParallel(model, group, parallel, placement, resolved.max_num_batched_tokens)


async def _serve(rank: int, worker: Worker, requests: RingReader, control: RingReader, outbox: Outbox,
                 heartbeat: "HeartbeatThread") -> None:
    failure: list[BaseException] = []
    tasks = [asyncio.ensure_future(_guard(coro, worker, failure)) for coro in
             (_drain(worker, requests, "request ring"), _drain(worker, control, "control ring"),
              _watch_heartbeats(heartbeat))]
    try:
        await worker.run()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if failure:
        raise failure[0]
    outbox.send(Shutdown(f"rank {rank} stopped"))


async def _guard(coro, worker: Worker, failure: list[BaseException]) -> None:
    """Run a side task of the worker; if it fails, record why and stop the worker (loudly)."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a ring task ends the worker
        failure.append(exc)
        worker.stop()


async def _drain(worker: Worker, reader: RingReader, name: str) -> None:
    """Hand every message of one ring to the worker; a failing ring raises RingFailure."""
    while True:
        try:
            msg = decode(await reader.get_async(timeout=3600.0), "to_worker")
        except RingTimeout:
            continue
        except IpcError as exc:
            raise RingFailure(f"{name}: {type(exc).__name__}: {exc}") from None
        if isinstance(msg, Submit):
            worker.submit(msg.request_id, msg.prompt_token_ids, msg.params, msg.kv_transfer_params, msg.images)
        elif isinstance(msg, Abort):
            worker.abort(msg.request_ids)
        elif isinstance(msg, Wake):
            worker.wake(msg.epoch)
        elif isinstance(msg, Shutdown):
            worker.stop()
            return


async def _watch_heartbeats(heartbeat: "HeartbeatThread") -> None:
    """Fail the worker if its heartbeat thread died (its status ring failed)."""
    while True:
        await asyncio.sleep(1.0)
        if heartbeat.failure is not None:
            raise heartbeat.failure


class HeartbeatThread(threading.Thread):
    """Sends a Heartbeat to the status ring every `interval_s`, whatever the worker's loop is
    doing (torch releases the GIL in its ops, so a long step does not silence it). It reads the
    engine's counters without locks: each is one int, and a heartbeat a step stale is fine."""

    def __init__(self, rank: int, worker: Worker, ring: RingWriter, interval_s: float = HEARTBEAT_S):
        super().__init__(name=f"ringserve-heartbeat-{rank}", daemon=True)
        self.rank, self.worker, self.ring, self.interval_s = rank, worker, ring, interval_s
        self.failure: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.ring.put(encode(self.beat()), timeout=10.0)
            except IpcError as exc:
                self.failure = RingFailure(f"status ring: {type(exc).__name__}: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - a silent heartbeat thread would look like a hung rank
                self.failure = exc
                return
            self._stop_event.wait(self.interval_s)

    def beat(self) -> Heartbeat:
        worker, engine = self.worker, self.worker.engine
        sched, st, blocks = engine.scheduler, engine.stats, engine.cache.manager.full
        ep = worker.lockstep.ep if worker.lockstep is not None else None
        pc = engine.prefix_cache
        return Heartbeat(self.rank, worker.stats.steps, worker.step_started_at, engine.model.layers_run,
                         len(sched.running), len(sched.waiting), blocks.num_used, blocks.num_blocks, time.time(),
                         sched.num_preemptions, st.spec_drafts, st.spec_draft_tokens,
                         list(st.spec_accepted_per_position), worker.stats.max_loop_pause_s,
                         list(ep.last_imbalance) if ep is not None else [], ep.rebalances if ep is not None else 0,
                         engine.connector.last_stats if engine.connector is not None else None,  # [kv-connector]
                         pc.stats.queries if pc is not None else 0, pc.stats.hits if pc is not None else 0,
                         worker.core_share.current if worker.core_share is not None else 0)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=2.0)
