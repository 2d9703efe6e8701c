"""The asyncio worker: serves submits and aborts, idles without burning a core, freezes the GC."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.weights import load_model
from engine.worker import Worker
from ipc.loop import new_event_loop
from ipc.messages import Finished, SamplingParams, TokenDelta


@pytest.fixture(scope="module")
def engine(checkpoint_factory):
    model = load_model(checkpoint_factory("tiny-upstream", index_topk=64), dtype=torch.float32, progress=False)
    return Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20,
                                      block_size=16))


def _serve(engine, scenario):
    """Run the worker loop and `scenario(worker, deltas)` on one uvloop; returns the deltas."""
    deltas = []  # every TokenDelta and Finished, in emission order
    worker = Worker(engine, lambda out: deltas.extend(out.deltas + out.finished))

    async def main():
        task = asyncio.ensure_future(worker.run())
        try:
            await scenario(worker, deltas)
        finally:
            worker.stop()
            await task

    loop = new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        worker.close()
    return deltas, worker


def _tokens(item) -> list[int]:
    return item.token_ids if isinstance(item, TokenDelta) else []


async def _until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_submit_stream_and_abort(engine):
    async def scenario(worker, deltas):
        worker.submit(1, [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
        worker.submit(2, [9] * 20, SamplingParams(max_tokens=500, ignore_eos=True))
        worker.submit(3, [1] * 20, SamplingParams(max_tokens=10**6))  # over the context: refused
        await _until(lambda: any(d.request_id == 2 and _tokens(d) for d in deltas))
        worker.abort([2])
        await _until(lambda: any(d.request_id == 2 and isinstance(d, Finished) for d in deltas))
        await _until(lambda: any(d.request_id == 1 and isinstance(d, Finished) for d in deltas))

    deltas, _ = _serve(engine, scenario)
    by = {}
    for d in deltas:
        by.setdefault(d.request_id, []).append(d)
    assert sum(len(_tokens(d)) for d in by[1]) == 5 and by[1][-1].reason == "length"
    assert by[2][-1].reason == "abort"
    assert by[3][-1].reason == "error" and "context length" in by[3][-1].error and by[3][-1].error_code == 400
    assert engine.cache.manager.full.num_used == 0 and engine.cache.manager.sliding.num_used == 0


def test_an_abort_that_overtakes_its_submission_still_lands(engine):
    """Aborts travel on their own ring, so one can arrive before its request's submission (queued
    behind others on the request ring): the submission is then finished as aborted, never run."""
    async def scenario(worker, deltas):
        worker.abort([7])  # not seen yet
        worker.submit(7, [4] * 12, SamplingParams(max_tokens=500, ignore_eos=True))
        worker.submit(8, [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
        await _until(lambda: {d.request_id for d in deltas if isinstance(d, Finished)} >= {7, 8})

    deltas, _ = _serve(engine, scenario)
    seven = [d for d in deltas if d.request_id == 7]
    assert len(seven) == 1 and isinstance(seven[0], Finished) and seven[0].reason == "abort"
    assert seven[0].completion_tokens == 0
    assert [d for d in deltas if d.request_id == 8][-1].reason == "length"
    assert engine.cache.manager.full.num_used == 0 and not engine.scheduler.has_work


def test_idle_worker_uses_no_cpu(engine):
    async def scenario(worker, deltas):
        await asyncio.sleep(0.05)
        t0, c0 = time.monotonic(), time.process_time()
        await asyncio.sleep(1.0)
        used = (time.process_time() - c0) / (time.monotonic() - t0)
        assert used < 0.05, f"idle worker used {used:.1%} of a core"

    _serve(engine, scenario)


def test_warm_up_freezes_the_gc(engine):
    worker = Worker(engine, lambda d: None)
    try:
        worker.warm_up()
        assert gc.get_freeze_count() > 0
        assert not engine.has_work
    finally:
        gc.unfreeze()
        worker.close()


class _IdleGroup:
    """A stand-in for Lockstep whose group never has work: every agreement is idle (stopping
    when this rank stops), counted as Lockstep counts them."""

    def __init__(self):
        self.agreements = 0

    def agree(self, plan):
        from engine.distributed.lockstep import StepPlan

        self.agreements += 1
        return StepPlan(False, stopping=plan.stopping)


def _serve_lockstep(engine, scenario):
    """A lockstep worker on an idle group: `scenario(worker, group, emitted)`; returns emitted."""
    emitted, group = [], _IdleGroup()
    worker = Worker(engine, emitted.append, group)

    async def main():
        task = asyncio.ensure_future(worker.run())
        try:
            await scenario(worker, group, emitted)
        finally:
            worker.stop()
            await task

    loop = new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        worker.close()
    return emitted


def test_an_idle_group_rank_parks_until_woken(engine):
    """After an idle agreement the rank says Parked(epoch) and makes no further agreement (no
    polling) until the client's Wake; then it agrees once more and parks at the next epoch."""
    from ipc.messages import Parked

    async def scenario(worker, group, emitted):
        await _until(lambda: emitted)
        await asyncio.sleep(0.3)
        assert group.agreements == 1 and emitted == [Parked(1)]
        worker.wake(1)
        await _until(lambda: len(emitted) == 2)
        assert group.agreements == 2 and emitted[1] == Parked(2)

    _serve_lockstep(engine, scenario)


def test_a_wake_before_the_park_is_not_lost(engine):
    """A Wake for an agreement this rank has not parked at yet (it raced the idle agreement) is
    remembered: the rank skips that park and agrees again at once; a stale one is ignored."""
    from ipc.messages import Parked

    async def scenario(worker, group, emitted):
        worker.wake(1)  # before the first agreement
        await _until(lambda: emitted)
        await asyncio.sleep(0.2)
        assert group.agreements == 2 and emitted == [Parked(2)]
        worker.wake(1)  # stale: the group is parked at 2 already
        await asyncio.sleep(0.2)
        assert group.agreements == 2 and emitted == [Parked(2)]
        worker.wake(2)
        await _until(lambda: len(emitted) == 2)
        assert group.agreements == 3 and emitted[1] == Parked(3)

    _serve_lockstep(engine, scenario)
