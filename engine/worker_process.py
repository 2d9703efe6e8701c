"""Entry point of a worker process: one engine, fed and drained through two shared-memory rings.

The server creates (and owns) both rings and starts this process with their names. The worker
attaches as reader of the request ring and writer of the output ring, loads the model, warms up,
announces `WorkerReady`, then runs the asyncio worker: requests and aborts in, token deltas,
finishes, errors and heartbeats out. Every message is codec bytes; nothing is pickled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import torch

from ipc import (Abort, Error, Finished, Heartbeat, RingReader, RingTimeout, RingWriter, Shutdown, Submit,
                 TokenDelta, WorkerReady, decode, encode)

from .config import ConfigError
from .engine import Engine, EngineConfig, TokenDelta as EngineDelta, default_dtype
from .sampling import SamplingError, SamplingParams
from .weights import WeightLoadError, load_model
from .worker import Worker, new_event_loop

logger = logging.getLogger(__name__)
HEARTBEAT_S = 0.25


def params_from_msg(p) -> SamplingParams:
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                          top_k=max(p.top_k, 0), min_p=p.min_p, presence_penalty=p.presence_penalty,
                          frequency_penalty=p.frequency_penalty, seed=p.seed,
                          logprobs=p.logprobs, stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos)


class _Outbox:
    """Encodes engine output into ring messages (request ids are ints on the wire)."""

    def __init__(self, writer: RingWriter):
        self.writer = writer

    def send(self, msg) -> None:
        self.writer.put(encode(msg, max_bytes=self.writer.capacity), timeout=60.0)

    def emit(self, d: EngineDelta) -> None:
        rid = int(d.request_id)
        if d.token_ids:
            self.send(TokenDelta(rid, list(d.token_ids), d.logprobs,
                                 [[(int(t), float(lp)) for t, lp in row] for row in d.top_logprobs]
                                 if d.top_logprobs else None))
        if d.error is not None:
            self.send(Error(rid, d.error, d.error_code))
        if d.finish_reason is not None:
            self.send(Finished(rid, d.finish_reason, d.num_prompt_tokens, d.num_output_tokens))


def worker_main(rank: int, model_dir: str, config_json: str, request_ring: str, output_ring: str,
                num_threads: int, device: str = "cpu") -> None:
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(num_threads)
    writer = RingWriter.attach(output_ring)
    reader = RingReader.attach(request_ring)
    outbox = _Outbox(writer)
    try:
        config = EngineConfig(**_config_fields(json.loads(config_json)))
        model = load_model(model_dir, dtype=default_dtype(config, device), device=device, progress=False,
                           load_mtp=bool(config.resolved().speculative_tokens))
        engine = Engine(model, config)
        worker = Worker(engine, outbox.emit)
        worker.warm_up()
        outbox.send(WorkerReady(rank, os.getpid(), engine.cache.manager.full.num_blocks, engine.config.block_size,
                                engine.max_model_len, device))
        loop = new_event_loop()
        try:
            loop.run_until_complete(_serve(rank, worker, reader, outbox))
        finally:
            loop.close()
    except Exception as exc:  # report, then exit non-zero: the server fails this rank's requests
        if not isinstance(exc, (ConfigError, WeightLoadError)):  # known errors: the server prints them
            logger.exception("worker %d failed", rank)
        try:
            outbox.send(Shutdown(f"rank {rank} failed: {type(exc).__name__}: {exc}"))
        finally:
            raise SystemExit(1)
    finally:
        reader.close()
        writer.close()


def _config_fields(raw: dict) -> dict:
    raw = dict(raw)
    raw["cuda_graph_sizes"] = tuple(raw.get("cuda_graph_sizes") or ())
    return raw


async def _serve(rank: int, worker: Worker, reader: RingReader, outbox: _Outbox) -> None:
    inbox = asyncio.ensure_future(_drain(worker, reader, outbox))
    beats = asyncio.ensure_future(_heartbeats(rank, worker, outbox))
    try:
        await worker.run()
    finally:
        for task in (inbox, beats):
            task.cancel()
        await asyncio.gather(inbox, beats, return_exceptions=True)
        outbox.send(Shutdown(f"rank {rank} stopped"))


async def _drain(worker: Worker, reader: RingReader, outbox: _Outbox) -> None:
    while True:
        try:
            msg = decode(await reader.get_async(timeout=3600.0))
        except RingTimeout:
            continue
        if isinstance(msg, Submit):
            try:
                params = params_from_msg(msg.params)
            except SamplingError as exc:
                outbox.send(Error(msg.request_id, str(exc), 400))
                outbox.send(Finished(msg.request_id, "error", len(msg.prompt_token_ids), 0))
                continue
            worker.submit(str(msg.request_id), list(msg.prompt_token_ids), params)
        elif isinstance(msg, Abort):
            worker.abort(str(msg.request_id))
        elif isinstance(msg, Shutdown):
            worker.stop()
            return


async def _heartbeats(rank: int, worker: Worker, outbox: _Outbox) -> None:
    engine = worker.engine
    while True:
        sched = engine.scheduler
        st = engine.stats
        outbox.send(Heartbeat(rank, worker.stats.steps, worker.step_started_at, len(sched.running), len(sched.waiting),
                              engine.cache.manager.full.num_used, engine.cache.manager.full.num_blocks, time.time(),
                              sched.num_preemptions, st.spec_drafts, st.spec_draft_tokens,
                              list(st.spec_accepted_per_position), worker.stats.max_loop_pause_s))
        await asyncio.sleep(HEARTBEAT_S)
