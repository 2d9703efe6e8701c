"""Entry points of child processes started (with spawn) by the ipc tests. Importable by name."""
from __future__ import annotations

import os
import struct
import time

import numpy as np

from ipc.ring import RingConfig, RingReader, RingWriter

STRESS_SEED = 1234
_PATTERN_BYTES = 1 << 16
_HEAD = struct.Struct("<QI")


def stress_plan(n: int, max_bytes: int) -> tuple[np.ndarray, np.ndarray, bytes]:
    """Deterministic sizes and offsets for n messages, and the pattern they are cut from."""
    rng = np.random.default_rng(STRESS_SEED)
    sizes = rng.integers(0, max_bytes - _HEAD.size + 1, size=n)
    big = rng.random(n) < 0.01  # 1% near the slot capacity
    sizes[big] = max_bytes - _HEAD.size
    offsets = rng.integers(0, _PATTERN_BYTES, size=n)
    pattern = rng.integers(0, 256, size=2 * _PATTERN_BYTES + max_bytes, dtype=np.uint8).tobytes()
    return sizes, offsets, pattern


def stress_message(i: int, size: int, offset: int, pattern: memoryview) -> bytes:
    return _HEAD.pack(i, size) + pattern[offset : offset + size]


def check_message(i: int, msg: memoryview, size: int, offset: int, pattern: memoryview) -> None:
    index, got_size = _HEAD.unpack_from(msg)
    if index != i or got_size != size or len(msg) != _HEAD.size + size:
        raise AssertionError(f"expected message {i} of {size} bytes, got {index} of {got_size} ({len(msg)})")
    if msg[_HEAD.size :] != pattern[offset : offset + size]:
        raise AssertionError(f"payload of message {i} differs")


def stress_writer(name: str, n: int, max_bytes: int) -> None:
    sizes, offsets, pattern = stress_plan(n, max_bytes)
    pat = memoryview(pattern)
    with RingWriter.attach(name) as w:
        for i in range(n):
            w.put(stress_message(i, int(sizes[i]), int(offsets[i]), pat), timeout=60)


def counting_writer(name: str, n: int, delay_s: float = 0.0) -> None:
    with RingWriter.attach(name) as w:
        for i in range(n):
            w.put(i.to_bytes(8, "little"), timeout=30)
            if delay_s:
                time.sleep(delay_s)


def writer_to_a_parked_reader(name: str, n: int) -> None:
    """Writes message i only once the reader has parked (its ``parked`` word is set), so every
    message must be delivered through the doorbell path."""
    from ipc import ring_layout as L

    with RingWriter.attach(name) as w:
        for i in range(n):
            deadline = time.monotonic() + 10
            # Wait for the reader to have consumed message i-1 and parked again for message i.
            while w._q[L.OFF_READ_COUNT // 8] < i or not w._i[L.OFF_READER_PARKED // 4]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the reader never parked before message {i}")
                time.sleep(0.0005)
            w.put(i.to_bytes(8, "little"), timeout=30)


def endless_writer(name: str, size: int) -> None:
    """Writes until killed; never closes."""
    w = RingWriter.attach(name)
    payload = bytes(range(256)) * (size // 256 + 1)
    i = 0
    while True:
        w.put(i.to_bytes(8, "little") + payload[: size - 8], timeout=60)
        i += 1


def idle_reader(name: str, seconds: float, out: "object") -> None:
    """Waits for data that never comes for ``seconds``; reports its own CPU seconds through ``out``."""
    r = RingReader.attach(name, RingConfig(timeout_s=seconds))
    t0 = os.times()
    start = time.monotonic()
    try:
        r.get(timeout=seconds)
    except TimeoutError:
        pass
    t1 = os.times()
    out.send(((t1.user - t0.user) + (t1.system - t0.system), time.monotonic() - start))
    r.close()


def echo(request_ring: str, reply_ring: str, n: int) -> None:
    """Reads n messages and writes each back (latency ping-pong partner)."""
    r = RingReader.attach(request_ring)
    with RingWriter.attach(reply_ring) as w:
        for _ in range(n):
            w.put(r.get(timeout=30), timeout=30)
    r.close()


def half_writer(name: str, n_complete: int, ready: "object") -> None:
    """Publishes n_complete messages, then stops halfway through filling the next slot, forever."""
    w = RingWriter.attach(name)
    for i in range(n_complete):
        w.put(i.to_bytes(8, "little") * 4, timeout=30)
    with w.acquire_write(1000) as view:
        view[:500] = b"\xab" * 500
        ready.set()
        time.sleep(3600)
