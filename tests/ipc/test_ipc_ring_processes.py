"""Rings across processes (spawn): stress, crash detection and recreation, idle CPU, lost wake-ups."""
from __future__ import annotations

import os
import signal
import time

import pytest

import ipc_children as kids
from ipc import ring_layout as L
from ipc.errors import PeerDied, RingClosed
from ipc.ring import RingConfig, RingReader, RingWriter
from ipc.segment import SHM_DIR


def _finish(proc, timeout: float = 30) -> None:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        pytest.fail("child did not finish")
    assert proc.exitcode == 0, f"child exit code {proc.exitcode}"


@pytest.mark.slow
def test_stress_one_million_random_sizes(spawn):
    """1,000,000 messages of random sizes (0..slot capacity): none lost, duplicated, reordered or corrupted."""
    n = 1_000_000
    config = RingConfig(slot_bytes=512, num_slots=64, timeout_s=60)
    max_bytes = config.payload_bytes
    sizes, offsets, pattern = kids.stress_plan(n, max_bytes)
    pat = memoryview(pattern)
    reader = RingReader.create(config)
    proc = spawn.Process(target=kids.stress_writer, args=(reader.name, n, max_bytes))
    proc.start()
    try:
        for i in range(n):
            with reader.acquire_read(timeout=60) as msg:
                kids.check_message(i, msg, int(sizes[i]), int(offsets[i]), pat)
        with pytest.raises(RingClosed):
            reader.get(timeout=10)
        _finish(proc)
        assert reader.stats.messages == n and reader.stats.corrupt == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        reader.close()


def test_writer_killed_mid_write_is_detected_and_ring_recreated(spawn):
    reader = RingReader.create(RingConfig(slot_bytes=2048, num_slots=8, timeout_s=10))
    ready = spawn.Event()
    proc = spawn.Process(target=kids.half_writer, args=(reader.name, 3, ready))
    proc.start()
    try:
        got = [reader.get(timeout=10) for _ in range(3)]
        assert got == [i.to_bytes(8, "little") * 4 for i in range(3)]
        assert ready.wait(10)
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerDied, match="recreate"):
            reader.get(timeout=10)
        assert time.monotonic() - t0 < 6, "death should be seen through the pidfd, not the 10 s timeout"
        proc.join(5)
        old = reader.name
        reader = reader.recreate()
        assert not os.path.exists(os.path.join(SHM_DIR, old))
        proc = spawn.Process(target=kids.counting_writer, args=(reader.name, 100))
        proc.start()
        assert [int.from_bytes(reader.get(timeout=10), "little") for _ in range(100)] == list(range(100))
        _finish(proc)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        reader.close()


def test_writer_killed_while_streaming_never_yields_a_bad_message(spawn):
    size = 64 * 1024  # large messages: the kill usually lands inside a copy or a CRC
    reader = RingReader.create(RingConfig(slot_bytes=size + 64, num_slots=4, timeout_s=10))
    proc = spawn.Process(target=kids.endless_writer, args=(reader.name, size))
    proc.start()
    try:
        expected = bytes(range(256)) * (size // 256 + 1)
        for i in range(200):
            msg = reader.get(timeout=10)
            assert int.from_bytes(msg[:8], "little") == i and msg[8:] == expected[: size - 8]
        os.kill(proc.pid, signal.SIGKILL)
        i = 200
        with pytest.raises(PeerDied):
            while True:  # drain what was published before the kill; then the death is reported
                msg = reader.get(timeout=10)
                assert int.from_bytes(msg[:8], "little") == i and msg[8:] == expected[: size - 8]
                i += 1
        assert reader.stats.corrupt == 0
        proc.join(5)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        reader.close()


def test_idle_reader_uses_almost_no_cpu(spawn):
    seconds = 2.0
    writer = RingWriter.create(RingConfig(slot_bytes=256, num_slots=4))
    parent_end, child_end = spawn.Pipe()
    proc = spawn.Process(target=kids.idle_reader, args=(writer.name, seconds, child_end))
    proc.start()
    try:
        assert parent_end.poll(seconds + 30)
        cpu_s, wall_s = parent_end.recv()
        _finish(proc)
    finally:
        writer.close()
    assert wall_s >= seconds * 0.9
    assert cpu_s / wall_s < 0.02, f"idle reader used {100 * cpu_s / wall_s:.2f}% of a core"


def test_sparse_messages_wake_a_parked_reader_without_lost_wakeups(spawn):
    # The writer puts each message only after the reader has parked, so every get goes through the
    # park/doorbell path whatever the machine's load (a busy machine cannot turn it into a spin win).
    reader = RingReader.create(RingConfig(slot_bytes=256, num_slots=4, timeout_s=10, park_tick_s=1.0))
    n = 50
    proc = spawn.Process(target=kids.writer_to_a_parked_reader, args=(reader.name, n))
    proc.start()
    try:
        t0 = time.monotonic()
        assert [int.from_bytes(reader.get(timeout=10), "little") for _ in range(n)] == list(range(n))
        elapsed = time.monotonic() - t0
        _finish(proc)
    finally:
        reader.close()
    assert reader.stats.parks >= n, "every message was written to a parked reader"
    assert reader.stats.lost_wakeups == 0
    # A lost doorbell would leave the reader asleep until its 1 s tick: 50 of them would take 50 s.
    assert elapsed < n * 1.0 / 4, "wake-ups were late (lost doorbells?)"


def test_slot_header_sits_where_the_docstring_says():
    assert L.CTRL_BYTES % 64 == 0 and L.SLOT_HEADER_BYTES == 32
    assert (L.SLOT_SEQ, L.SLOT_EPOCH, L.SLOT_LENGTH, L.SLOT_CRC) == (0, 8, 16, 20)
