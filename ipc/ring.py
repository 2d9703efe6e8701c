"""Single-producer single-consumer ring of fixed-size slots in POSIX shared memory.

One writer process, one reader process, one ring per direction. Messages are opaque bytes (the codec's
output); each fits in one slot or is refused with MessageTooLarge.

Memory layout (native-endian words; slot_bytes is a multiple of 64, so every slot is line-aligned)::

    offset 0    +--------------------------------------------------------------+
                | magic u64 | version u32 | slot_bytes u32 | num_slots u32 |    |  line 0: fixed
                | writer_pid u32 | reader_pid u32 | epoch u64 (writer's)       |  at create / claim
    64          | write_count u64 | writer_parked u32 | writer_closed u32      |  line 1: writer
    128         | read_count u64  | reader_parked u32 | reader_closed u32      |  line 2: reader
    192         | (spare line)                                                 |
    256         +--------------------------------------------------------------+
                | slot 0: seq u64 | epoch u64 | length u32 | crc32c u32 | pad8 |  32-byte header
                |         payload (slot_bytes - 32)                            |
                +--------------------------------------------------------------+
                | slot 1 ... slot num_slots-1                                  |
                +--------------------------------------------------------------+

Message k (k = 0, 1, ...) lives in slot k % num_slots with seq = k + 1. Slot states, as seen by
the reader waiting for message k: seq == k + 1 - num_slots (or 0 on the first lap): empty, not yet
written; seq == SEQ_BUSY: being written; seq == k + 1: published; anything else: corrupt.
crc32c covers (seq, epoch, length) and the payload.

Ordering rule (seqlock style; the NOTE comments in the code mark each step):

  writer, message k:  wait until k - read_count < num_slots   (full ring = backpressure)
                      seq := BUSY; [weak fence]
                      payload, epoch, length, crc := ...; [weak fence]
                      seq := k + 1                             <- published LAST
                      [full fence]; if reader_parked: ring the reader's doorbell
  reader, message k:  wait until seq == k + 1
                      read epoch, length, crc; [weak fence]; check length <= capacity,
                      epoch == writer epoch, crc32c(header, payload) == crc; [weak fence]
                      re-read seq: still k + 1, else torn     <- the seqlock re-check
                      ... use payload ...; [weak fence]; read_count := k + 1
                      [full fence]; if writer_parked: ring the writer's doorbell

Why the store order holds in CPython: each header word is stored with one ``memoryview`` item
assignment, i.e. a single aligned 8- or 4-byte store inside a C call; CPython never reorders two
Python statements, and the C compiler cannot move stores across the opaque calls between them. On
x86-64 (TSO) the hardware keeps stores in order and loads in order, so "weak fence" is nothing:
a reader that sees seq == k + 1 sees the payload written before it. On AArch64 (weakly ordered) the
weak fence is a real barrier (see ``ipc.doorbell.Fence``). The "full fence" (StoreLoad) is needed
on both, for the parked-flag handshake (see ``ipc.ring_base``).

What the reader re-checks, and why nothing torn, stale or corrupt gets through even if an argument
above failed: it re-reads seq after validating (a slot rewritten meanwhile is torn), compares the
slot epoch with the writer's epoch (a slot from an earlier writer is stale), bounds the length, and
verifies CRC32C over header and payload. A failed check is retried a few times (a reordering race
heals in nanoseconds), then the slot is rejected: ``CorruptSlot`` is raised, ``stats.corrupt`` is
bumped, an error is logged and the ring is poisoned. Rings are never resumed: after a corrupt slot,
a dead peer (pidfd) or a changed epoch, the owner calls ``recreate()`` and the peer attaches anew.
While a reader holds a slot (acquire_read) the writer cannot reuse it, so a validated view stays
valid until it is handed back.
"""
from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from ipc import ring_layout as L
from ipc.errors import MessageTooLarge, RingError
from ipc.ring_base import RingEndpoint, RingStats
from ipc.ring_layout import RingConfig

Buffer = bytes | bytearray | memoryview

__all__ = ["RingConfig", "RingReader", "RingStats", "RingWriter"]

_CONFIRM_TRIES = 3


def _refcount(view: memoryview) -> int:
    """Reference count seen from a helper's frame; _release measures from the same depth."""
    return sys.getrefcount(view)


def _release(view: memoryview, refs: int) -> bool:
    """Release a lent slot view; False if it escaped (live exports, or references beyond the
    caller's own ``with ... as view`` name, which is allowed: it is released and unusable after)."""
    escaped = sys.getrefcount(view) > refs + 1
    try:
        view.release()
    except BufferError:
        escaped = True
    return not escaped


class RingWriter(RingEndpoint):
    """The writing end. ``put`` copies bytes in; ``acquire_write`` lends the slot for zero-copy fills."""

    ROLE, PEER_ROLE = "writer", "reader"
    OFF_PID, OFF_PEER_PID = L.OFF_WRITER_PID, L.OFF_READER_PID
    OFF_PARKED, OFF_PEER_PARKED = L.OFF_WRITER_PARKED, L.OFF_READER_PARKED
    OFF_CLOSED, OFF_PEER_CLOSED = L.OFF_WRITER_CLOSED, L.OFF_READER_CLOSED
    MY_FIFO = 1

    def _claim(self) -> None:
        super()._claim()
        self._epoch = secrets.randbits(64) | 1
        self._q[L.OFF_EPOCH // 8] = self._epoch

    def put(self, data: Buffer, timeout: float | None = None) -> None:
        """Copy ``data`` into the next slot and publish it; waits (bounded) while the ring is full."""
        src = memoryview(data).cast("B")
        n = src.nbytes
        start = self._begin(n, timeout)
        self._mv[start : start + n] = src
        self._publish(n)

    async def put_async(self, data: Buffer, timeout: float | None = None) -> None:
        """Like ``put`` but parks on the event loop instead of blocking it when the ring is full."""
        src = memoryview(data).cast("B")
        self._check_size(src.nbytes)
        deadline, t = self._deadline(timeout)
        if not self._has_space():
            await self._park_async(self._has_space, deadline, "a free slot", t)
        start = self._begin(src.nbytes, timeout)
        self._mv[start : start + src.nbytes] = src
        self._publish(src.nbytes)

    @contextmanager
    def acquire_write(self, nbytes: int, timeout: float | None = None) -> Iterator[memoryview]:
        """Lend the next slot's first ``nbytes`` payload bytes; publish them when the block exits.

        If the block raises, nothing is published. The view must not outlive the block.
        """
        start = self._begin(nbytes, timeout)
        view = self._mv[start : start + nbytes]
        refs = _refcount(view)
        try:
            yield view
        except BaseException:
            _release(view, refs)
            self._abandon()
            raise
        if not _release(view, refs):
            self._abandon()
            raise RingError("a view of the slot outlived acquire_write; nothing was published")
        self._publish(nbytes)

    @property
    def capacity(self) -> int:
        """Largest payload one message may have, in bytes."""
        return self.config.payload_bytes

    def _check_size(self, nbytes: int) -> None:
        if nbytes > self.config.payload_bytes:
            raise MessageTooLarge(
                f"message of {nbytes} bytes exceeds the ring's slot payload capacity of "
                f"{self.config.payload_bytes} bytes (slot_bytes={self.config.slot_bytes}); "
                "raise RingConfig.slot_bytes or split the message"
            )

    def _has_space(self) -> bool:
        return self._next - self._q[L.OFF_READ_COUNT // 8] < self.config.num_slots

    def _slot(self) -> int:
        return L.CTRL_BYTES + (self._next % self.config.num_slots) * self.config.slot_bytes

    def _begin(self, nbytes: int, timeout: float | None) -> int:
        """Wait for a free slot, mark it BUSY, return the payload's byte offset."""
        self._check_usable()
        self._check_size(nbytes)
        if not self._has_space():
            deadline, t = self._deadline(timeout)
            self._wait(self._has_space, deadline, "a free slot", t)
        base = self._slot()
        self._prev_seq = self._q[base // 8]
        self._q[base // 8] = L.SEQ_BUSY
        self._fence.weak()  # NOTE: BUSY is visible before any payload byte changes.
        return base + L.SLOT_HEADER_BYTES

    def _abandon(self) -> None:
        self._q[self._slot() // 8] = self._prev_seq

    def _publish(self, nbytes: int) -> None:
        base = self._slot()
        seq = self._next + 1
        payload = self._mv[base + L.SLOT_HEADER_BYTES : base + L.SLOT_HEADER_BYTES + nbytes]
        crc = L.slot_crc(seq, self._epoch, nbytes, payload)
        payload.release()
        self._q[(base + L.SLOT_EPOCH) // 8] = self._epoch
        self._i[(base + L.SLOT_LENGTH) // 4] = nbytes
        self._i[(base + L.SLOT_CRC) // 4] = crc
        self._fence.weak()  # NOTE: header and payload are visible before seq.
        self._q[base // 8] = seq  # NOTE: published last.
        self._q[L.OFF_WRITE_COUNT // 8] = seq
        self._next = seq
        self.stats.messages += 1
        self.stats.bytes += nbytes
        self._ring_peer_if_parked()


class RingReader(RingEndpoint):
    """The reading end. ``get`` copies out; ``acquire_read`` lends the validated payload zero-copy."""

    ROLE, PEER_ROLE = "reader", "writer"
    OFF_PID, OFF_PEER_PID = L.OFF_READER_PID, L.OFF_WRITER_PID
    OFF_PARKED, OFF_PEER_PARKED = L.OFF_READER_PARKED, L.OFF_WRITER_PARKED
    OFF_CLOSED, OFF_PEER_CLOSED = L.OFF_READER_CLOSED, L.OFF_WRITER_CLOSED
    MY_FIFO = 0

    _epoch = 0

    def get(self, timeout: float | None = None) -> bytes:
        """Wait (bounded) for the next message and return a copy of it."""
        view = self._acquire(timeout)
        nbytes = view.nbytes
        try:
            return bytes(view)
        finally:
            view.release()
            self._hand_back(nbytes)

    def poll(self) -> bytes | None:
        """The next message if one is published now, else None; never waits."""
        self._check_usable()
        if not self._published():
            return None
        view = self._validate()
        nbytes = view.nbytes
        try:
            return bytes(view)
        finally:
            view.release()
            self._hand_back(nbytes)

    async def get_async(self, timeout: float | None = None) -> bytes:
        """Like ``get`` but parks on the running event loop (``add_reader``), never blocking it."""
        self._check_usable()
        if not self._published():
            deadline, t = self._deadline(timeout)
            await self._park_async(self._published, deadline, "a message", t)
        view = self._validate()
        nbytes = view.nbytes
        try:
            return bytes(view)
        finally:
            view.release()
            self._hand_back(nbytes)

    @contextmanager
    def acquire_read(self, timeout: float | None = None) -> Iterator[memoryview]:
        """Lend the next validated payload without copying; the slot is handed back on exit.

        The message counts as consumed even if the block raises. The view must not outlive the block:
        a reference to the lent view still held at exit raises RingError and poisons the ring.
        Derived views (slices, numpy.frombuffer) cannot be tracked: copy what you keep.
        """
        view = self._acquire(timeout)
        nbytes = view.nbytes
        refs = _refcount(view)
        try:
            yield view
        finally:
            kept = not _release(view, refs)  # NOTE: own statement, so no extra reference is on the stack
            self._hand_back(nbytes, escaped=kept)

    def pending(self) -> int:
        """Messages published but not yet consumed (a snapshot)."""
        return self._q[L.OFF_WRITE_COUNT // 8] - self._next

    def _slot(self) -> int:
        return L.CTRL_BYTES + (self._next % self.config.num_slots) * self.config.slot_bytes

    def _published(self) -> bool:
        return self._q[self._slot() // 8] == self._next + 1

    def _acquire(self, timeout: float | None) -> memoryview:
        self._check_usable()
        if not self._published():
            deadline, t = self._deadline(timeout)
            self._wait(self._published_or_corrupt, deadline, "a message", t)
        return self._validate()

    def _published_or_corrupt(self) -> bool:
        """Like _published, but a sequence that is neither "not yet" nor "ready" ends the wait too,
        so that _validate reports it instead of the wait running into its timeout."""
        seq = self._q[self._slot() // 8]
        expect = self._next + 1
        not_yet = expect - self.config.num_slots if self._next >= self.config.num_slots else 0
        return seq != not_yet and seq != L.SEQ_BUSY

    def _check_epoch(self) -> None:
        epoch = self._q[L.OFF_EPOCH // 8]
        if self._epoch == 0:
            self._epoch = epoch
        elif epoch != self._epoch:
            self._broken = "writer epoch changed"
            raise RingError(f"ring {self.name}: writer epoch changed; rings are never resumed")

    def _validate(self) -> memoryview:
        """Return the payload view of message ``_next`` after every check passes, else raise."""
        base = self._slot()
        q, i = self._q, self._i
        expect = self._next + 1
        if self._epoch == 0:
            self._epoch = q[L.OFF_EPOCH // 8]
        for attempt in range(_CONFIRM_TRIES):
            seq, epoch = q[base // 8], q[(base + L.SLOT_EPOCH) // 8]
            n, crc = i[(base + L.SLOT_LENGTH) // 4], i[(base + L.SLOT_CRC) // 4]
            self._fence.weak()  # NOTE: header loads happen before payload loads.
            if seq != expect:
                reason, detail = "sequence", f"slot holds seq {seq}, expected {expect}"
            elif n > self.config.payload_bytes:
                reason, detail = "length", f"length {n} > capacity {self.config.payload_bytes}"
            elif epoch != self._epoch:
                reason, detail = "stale epoch", f"slot epoch {epoch:#x}, writer epoch {self._epoch:#x}"
            else:
                start = base + L.SLOT_HEADER_BYTES
                view = self._mv[start : start + n]
                if L.slot_crc(seq, epoch, n, view) == crc:
                    self._fence.weak()  # NOTE: payload loads happen before the seq re-check.
                    if q[base // 8] == expect:
                        return view
                    reason, detail = "torn", f"seq changed from {expect} while reading"
                else:
                    reason, detail = "crc", f"CRC32C mismatch on message {self._next} ({n} bytes)"
                view.release()
            if attempt + 1 < _CONFIRM_TRIES:
                os.sched_yield()
        raise self._poison(reason, detail)

    def _hand_back(self, nbytes: int, escaped: bool = False) -> None:
        """Give the current slot back to the writer (the caller has released its view)."""
        self._fence.weak()  # NOTE: all payload loads are done before the slot is handed back.
        self._next += 1
        self._q[L.OFF_READ_COUNT // 8] = self._next
        self.stats.messages += 1
        self.stats.bytes += nbytes
        self._ring_peer_if_parked()
        if escaped:
            self._broken = "a slot view escaped acquire_read"
            raise RingError("a view of the slot outlived acquire_read; the ring can no longer be trusted")
