"""Worker processes behind shared-memory rings: DP generation, dead and stuck ranks, clean shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from engine.config import EngineConfig
from ipc.loop import new_event_loop
from ipc import RingConfig
from ipc.messages import Finished, SamplingParams
from ipc.segment import list_segments, remove_orphans
from server.engine_client import EngineClient


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    from tokenization.synthetic_bpe import write_tokenizer

    path = checkpoint_factory("tiny-upstream", index_topk=64)
    if not (path / "tokenizer.json").exists():
        write_tokenizer(path, 512)
    return path


def _worker_children() -> list[str]:
    out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "server.worker_entry"], capture_output=True,
                         text=True).stdout
    return out.split()


def _run(coro):
    loop = new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def _config():
    return EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory_bytes=16 << 20, block_size=16)


def test_dp2_generate_equals_dp1(model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": [3 + i, 40 + 7 * i, 9, 100 + i] * (i + 1)})
                                 for i in range(6)) + "\n")
    outs = {}
    for dp in (1, 2):
        proc = subprocess.run([sys.executable, "-m", "server.cli", "generate", str(model_dir), "--prompts-file",
                               str(prompts), "--max-tokens", "8", "--json", "--ignore-eos", "--dp", str(dp),
                               "--kv-cache-memory", "0.05", "--block-size", "16",
                               "--cpu-matmul-precision", "fp32"],  # exact: dp 1 and 2 batch differently
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        outs[dp] = [json.loads(line)["token_ids"] for line in proc.stdout.splitlines()]
    assert outs[1] == outs[2] and len(outs[1]) == 6
    assert remove_orphans() == []  # no ring outlived the process that created it


def test_killed_worker_fails_only_its_requests_and_shutdown_leaves_nothing(model_dir):
    async def scenario():
        client = EngineClient(model_dir, _config(), dp=2, threads_per_worker=1, stuck_after_s=1.0)
        await client.start()
        try:
            long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
            results: dict[int, tuple[str, str | None, int]] = {}

            async def run(i):
                n, last = 0, None
                async for item in client.generate([5 + i, 6, 7], long, request_id=100 + i):
                    if isinstance(item, Finished):
                        last = item
                    else:
                        n += len(item.token_ids)
                results[i] = (last.reason, last.error, n)

            tasks = [asyncio.ensure_future(run(i)) for i in range(4)]
            victim = client.ranks[0]
            # kill as soon as all four are placed: 120 tokens of the tiny model can take
            # under 0.5 s on a fast CPU, so a fixed wait could find them already finished
            deadline = time.monotonic() + 60
            while sum(len(r.inflight) for r in client.ranks) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            on_victim = set(victim.inflight)
            assert on_victim and len(on_victim) < 4
            os.kill(victim.link.process.pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            for i in range(4):
                reason, error, n = results[i]
                if 100 + i in on_victim:
                    assert reason == "error" and "rank 0 died" in error
                else:
                    assert reason == "length" and n == 120
            assert not client.healthy
        finally:
            await client.shutdown()

    _run(scenario())
    assert not [n for n in list_segments() if n.startswith(f"rsring-{os.getpid()}-")]
    assert not _worker_children()


def test_watchdog_names_a_stuck_rank(model_dir):
    async def scenario():
        client = EngineClient(model_dir, _config(), dp=1, threads_per_worker=1, stuck_after_s=1.0,
                              liveness_timeout_s=1.0)
        await client.start()
        pid = client.ranks[0].link.process.pid
        try:
            await asyncio.sleep(0.6)  # a heartbeat or two
            os.kill(pid, signal.SIGSTOP)  # a rank that stops answering mid-run
            deadline = time.monotonic() + 10
            while 0 not in client.stuck and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert "rank 0 stuck" in client.stuck[0] and "step" in client.stuck[0]
        finally:
            os.kill(pid, signal.SIGCONT)
            await client.shutdown()

    _run(scenario())
    assert not [n for n in list_segments() if n.startswith(f"rsring-{os.getpid()}-")]


def _beat(step: int, progress: int, running: bool):
    from ipc.messages import Heartbeat

    return Heartbeat(0, step, 1.0 if running else 0.0, progress, 1, 0, 3, 10, 0.0)


def test_watchdog_tells_a_slow_step_from_a_stuck_one():
    """Silence beyond the liveness timeout is a stopped process; a step whose layers stop moving
    beyond the watchdog timeout is stuck; a long step that keeps running layers is neither."""
    from server.engine_client import watchdog_verdict

    slow = watchdog_verdict(0, _beat(7, 1234, running=True), silent_s=0.3, stalled_s=0.2, liveness_timeout_s=5,
                            stuck_after_s=60)
    assert slow is None  # a 10-minute prefill that reports layer after layer never trips it
    stuck = watchdog_verdict(0, _beat(7, 1234, running=True), silent_s=0.3, stalled_s=61, liveness_timeout_s=5,
                             stuck_after_s=60)
    assert "rank 0 stuck" in stuck and "step 8 has run no layer for 61.0 s" in stuck
    stopped = watchdog_verdict(0, _beat(7, 1234, running=True), silent_s=6, stalled_s=6, liveness_timeout_s=5,
                               stuck_after_s=60)
    assert "no heartbeat for 6.0 s" in stopped and "step 8 was running" in stopped
    idle = watchdog_verdict(0, _beat(7, 1234, running=False), silent_s=0.3, stalled_s=1000, liveness_timeout_s=5,
                            stuck_after_s=60)
    assert idle is None  # an idle rank makes no progress and is fine


def test_heartbeats_come_from_their_own_thread_during_a_long_step():
    """The worker's heartbeat thread keeps sending while the loop thread is busy, and each beat
    carries the layer counter as it moves."""
    from types import SimpleNamespace

    from engine.worker_process import HeartbeatThread
    from ipc import RingReader, RingWriter, decode

    model = SimpleNamespace(layers_run=0)
    sched = SimpleNamespace(running=[1], waiting=[], num_preemptions=0)
    engine = SimpleNamespace(model=model, scheduler=sched, cache=SimpleNamespace(
        manager=SimpleNamespace(full=SimpleNamespace(num_used=1, num_blocks=9))),
        stats=SimpleNamespace(spec_drafts=0, spec_draft_tokens=0, spec_accepted_per_position=[]),
        connector=None, prefix_cache=None)
    worker = SimpleNamespace(engine=engine, stats=SimpleNamespace(steps=4, max_loop_pause_s=0.0), core_share=None,
                             step_started_at=time.time(), lockstep=None)
    reader = RingReader.create(RingConfig(slot_bytes=4096, num_slots=64))
    writer = RingWriter.attach(reader.name)
    beats = HeartbeatThread(0, worker, writer, interval_s=0.02)
    beats.start()
    try:
        seen = []
        deadline = time.monotonic() + 5
        while len(set(seen)) < 4 and time.monotonic() < deadline:
            model.layers_run += 1  # the "step" runs layers on this thread, holding the GIL between them
            busy_until = time.monotonic() + 0.03
            while time.monotonic() < busy_until:
                pass
            while (data := reader.poll()) is not None:
                seen.append(decode(data).progress)
        assert beats.failure is None
        assert len(set(seen)) >= 4 and seen == sorted(seen)
    finally:
        beats.stop()
        writer.close()
        reader.close()
    assert not beats.is_alive()


class _RecordingLink:
    """A RankLink stand-in that records what the client sends on it."""

    def __init__(self):
        self.sent: list[tuple[str, object]] = []

    async def send(self, channel, data, timeout):
        from ipc import decode

        self.sent.append((channel, decode(data, "to_worker")))


def _grouped_client(n: int):
    from engine.config import ParallelConfig
    from server.engine_client import _Rank

    client = EngineClient("unused", EngineConfig(), parallel=ParallelConfig(data_parallel_size=n,
                                                                            enable_expert_parallel=True))
    client.ranks = [_Rank(i, _RecordingLink()) for i in range(n)]
    return client


def test_a_parked_report_with_requests_in_flight_wakes_the_whole_group():
    """Expert parallelism: a rank reporting Parked(epoch) while the group has requests in flight
    (a submission that raced the idle agreement) gets the whole group woken for that epoch; with
    none in flight the client only remembers the park, and the next submission wakes the rest."""
    from ipc.messages import Wake

    async def main():
        client = _grouped_client(3)
        a, b, c = client.ranks
        client._on_parked(a, 4)
        assert a.parked == 4 and not a.link.sent  # nothing in flight: a parked group, left alone
        b.unfinished.add(17)
        client._on_parked(c, 4)
        await asyncio.gather(*client._background)
        assert [r.link.sent for r in client.ranks] == [[("control", Wake(4))]] * 3
        assert all(r.parked is None for r in client.ranks)
        client._on_parked(a, 5)
        b.unfinished.clear()
        client._on_parked(b, 5)
        client._on_parked(c, 5)
        await client._wake_group(5, busy=b)  # what a submission to b does
        assert [r.link.sent[-1] for r in (a, c)] == [("control", Wake(5))] * 2 and len(b.link.sent) == 1

    _run(main())
