"""Drive one measured run: arrivals, the client-side concurrency limit, session trees, scrapes.

Open-loop workloads (fixed): request i becomes ready at the i-th arrival of a gamma process
(`burstiness` = shape; 1 = Poisson; rate = inf sends all at once, as vLLM), then waits for one
of `max_concurrency` slots; `ready_s` and `send_s` record both instants. Session workloads
(agentx, trace): `max_concurrency` lanes each play one session tree at a time (concurrency =
live trees); a request is ready after its think time and is sent at once. A spec source turns
each turn into a request: `TreeTexts` (one user message of block text) or, for the agentx
request shape, `conversation.Conversations` (the growing chat history). Warm-up requests run
before the first scrape and are not measured.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
import numpy as np
from tqdm import tqdm

from perf.serving import client, server_api
from perf.serving.prom_metrics import gauge
from perf.serving.records import RequestRecord, RequestSpec
from perf.serving.textgen import BlockText
from perf.serving.trace import Session, TraceRequest


@dataclass(slots=True)
class RunConfig:
    """Client behaviour of one run."""

    api: client.ApiConfig
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    show_progress: bool = True
    metrics_interval_s: float = 2.0
    request_timeout_s: float = 6 * 3600.0
    duration_s: float | None = None
    think_time_scale: float = 1.0


@dataclass(slots=True)
class RunResult:
    """Everything measured in one run, before summarising."""

    records: list[RequestRecord]
    start_s: float
    end_s: float
    metrics_before: server_api.Samples | None = None
    metrics_after: server_api.Samples | None = None
    dp_samples: list[float] = field(default_factory=list)
    warmup_failures: int = 0


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Ready time of each request (s after start): gamma inter-arrivals with mean 1/rate."""
    if n == 0:
        return []
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    rng = np.random.default_rng([seed, 11])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


def http_session(cfg: RunConfig) -> aiohttp.ClientSession:
    """A pooled session with no connection cap (the benchmark, not aiohttp, limits concurrency)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s))


async def _sample_gauge(http: aiohttp.ClientSession, cfg: RunConfig, out: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        v = gauge(await server_api.scrape(http, cfg.api.base_url, cfg.api.headers()))
        if v is not None:
            out.append(v)
        try:
            await asyncio.wait_for(stop.wait(), cfg.metrics_interval_s)
        except asyncio.TimeoutError:
            pass


async def _measured(http: aiohttp.ClientSession, cfg: RunConfig, body: Callable[[float], Awaitable[list[RequestRecord]]],
                    warmup_failures: int) -> RunResult:
    """Scrape, run `body(start)`, scrape again, sampling the DP-imbalance gauge in between."""
    headers = cfg.api.headers()
    before = await server_api.scrape(http, cfg.api.base_url, headers)
    dp: list[float] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_gauge(http, cfg, dp, stop)) if before is not None else None
    start = time.perf_counter()
    records = await body(start)
    end = max([start] + [r.end_s for r in records])
    stop.set()
    if sampler:
        await sampler
    after = await server_api.scrape(http, cfg.api.base_url, headers)
    return RunResult(records, start, end, before, after, dp, warmup_failures)


async def _warmup(http: aiohttp.ClientSession, cfg: RunConfig, specs: Sequence[RequestSpec]) -> int:
    """Send warm-ups with the run's concurrency; returns how many failed."""
    sem = asyncio.Semaphore(max(1, cfg.max_concurrency or len(specs) or 1))

    async def one(spec: RequestSpec) -> bool:
        async with sem:
            rec = RequestRecord(spec, ready_s=time.perf_counter())
            return (await client.send(http, cfg.api, rec)).ok

    results = await asyncio.gather(*(one(s) for s in specs))
    return sum(1 for ok in results if not ok)


async def run_open_loop(cfg: RunConfig, specs: Sequence[RequestSpec], warmups: Sequence[RequestSpec] = ()) -> RunResult:
    """The fixed workload: gamma arrivals, then a client-side concurrency slot, then send."""
    async with http_session(cfg) as http:
        failed = await _warmup(http, cfg, warmups)
        offsets = arrival_offsets(len(specs), cfg.request_rate, cfg.burstiness, cfg.seed)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(specs), disable=not cfg.show_progress, desc="requests")

        async def one(spec: RequestSpec, ready_at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, ready_at - time.perf_counter()))
            rec = RequestRecord(spec, ready_s=time.perf_counter())
            if sem is None:
                await client.send(http, cfg.api, rec)
            else:
                async with sem:
                    await client.send(http, cfg.api, rec)
            bar.update(1)
            return rec

        async def body(start: float) -> list[RequestRecord]:
            return list(await asyncio.gather(*(one(s, start + o) for s, o in zip(specs, offsets))))

        try:
            return await _measured(http, cfg, body, failed)
        finally:
            bar.close()


class SpecSource(Protocol):
    def spec(self, tree_index: int, req: TraceRequest, max_tokens: int | None = None) -> RequestSpec: ...

    def finish(self, tree_index: int, session_id: str) -> None: ...


class TreeTexts:
    """Turns trace requests into specs: per-tree marker, salted hash ids, block text."""

    def __init__(self, blocks: BlockText, nonce: str) -> None:
        self.blocks, self.nonce = blocks, nonce

    def spec(self, tree_index: int, req: TraceRequest, max_tokens: int | None = None) -> RequestSpec:
        marker = f"[{self.nonce}:{tree_index}]"
        salted = tuple((tree_index << 40) | h for h in req.hash_ids)
        return RequestSpec(prompt=self.blocks.prompt(marker, req.hash_ids, req.input_length),
                           max_tokens=max_tokens or req.output_length, input_length=req.input_length,
                           session_id=req.session_id, turn=req.turn, hash_ids=salted)

    def finish(self, tree_index: int, session_id: str) -> None:
        """Nothing to forget: each turn's text stands alone."""


def count_requests(trees: Sequence[Session]) -> int:
    return sum(len(t.all_requests()) for t in trees)


async def run_sessions(cfg: RunConfig, trees: Sequence[Session], texts: SpecSource,
                       warmups: Sequence[RequestSpec] = ()) -> RunResult:
    """Play session trees on `max_concurrency` lanes (see the module docstring)."""
    lanes = max(1, min(cfg.max_concurrency or len(trees), len(trees) or 1))
    async with http_session(cfg) as http:
        failed = await _warmup(http, cfg, warmups)
        bar = tqdm(total=count_requests(trees), disable=not cfg.show_progress, desc="requests")
        records: list[RequestRecord] = []

        async def play(sess: Session, tree_index: int, deadline: float) -> None:
            try:
                for req in sess.requests:
                    await asyncio.sleep(req.delay_ms / 1000.0 * cfg.think_time_scale)
                    if time.perf_counter() >= deadline:
                        return
                    rec = RequestRecord(texts.spec(tree_index, req), ready_s=time.perf_counter())
                    records.append(rec)
                    await client.send(http, cfg.api, rec)
                    bar.update(1)
                    subs = sess.children.get(req.turn, [])
                    if subs:
                        await asyncio.gather(*(play(s, tree_index, deadline) for s in subs))
            finally:
                texts.finish(tree_index, sess.session_id)

        async def body(start: float) -> list[RequestRecord]:
            deadline = start + cfg.duration_s if cfg.duration_s else math.inf
            queue = list(enumerate(trees))[::-1]

            async def lane() -> None:
                while queue and time.perf_counter() < deadline:
                    idx, tree = queue.pop()
                    await play(tree, idx, deadline)

            await asyncio.gather(*(lane() for _ in range(lanes)))
            return records

        try:
            return await _measured(http, cfg, body, failed)
        finally:
            bar.close()
