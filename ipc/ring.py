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
from ipc.doorbell import IS_TSO
from ipc.ring_base import RingEndpoint, RingStats
from ipc.ring_layout import RingConfig

Buffer = bytes | bytearray | memoryview

__all__ = ["RingConfig", "RingReader", "RingStats", "RingWriter"]

_CONFIRM_TRIES = 3
# Word indices of the hot control words (q: 8-byte words, i: 4-byte words).
_WRITE_COUNT = L.OFF_WRITE_COUNT // 8
_READ_COUNT = L.OFF_READ_COUNT // 8
_READER_PARKED = L.OFF_READER_PARKED // 4
_WRITER_PARKED = L.OFF_WRITER_PARKED // 4


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
        n = len(data) if isinstance(data, bytes) else memoryview(data).nbytes
        start = self._begin(n, timeout)
        self._mv[start : start + n] = data if isinstance(data, bytes) else memoryview(data).cast("B")
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
        if self._closed or self._broken is not None:
            self._check_usable()
        if nbytes > self._payload_bytes:
            self._check_size(nbytes)
        q = self._q
        if self._next - q[_READ_COUNT] >= self._num_slots:
            deadline, t = self._deadline(timeout)
            self._wait(self._has_space, deadline, "a free slot", t)
        base = L.CTRL_BYTES + (self._next % self._num_slots) * self._slot_bytes
        self._prev_seq = q[base // 8]
        q[base // 8] = L.SEQ_BUSY
        if not IS_TSO:
            self._fence.weak()  # NOTE: BUSY is visible before any payload byte changes.
        return base + L.SLOT_HEADER_BYTES

    def _abandon(self) -> None:
        self._q[self._slot() // 8] = self._prev_seq

    def _publish(self, nbytes: int) -> None:
        base = L.CTRL_BYTES + (self._next % self._num_slots) * self._slot_bytes
        seq = self._next + 1
        q, i, epoch = self._q, self._i, self._epoch
        start = base + L.SLOT_HEADER_BYTES
        with self._mv[start : start + nbytes] as payload:
            crc = L.slot_crc(seq, epoch, nbytes, payload)
        q[(base + L.SLOT_EPOCH) // 8] = epoch
        i[(base + L.SLOT_LENGTH) // 4] = nbytes
        i[(base + L.SLOT_CRC) // 4] = crc
        if not IS_TSO:
            self._fence.weak()  # NOTE: header and payload are visible before seq.
        q[base // 8] = seq  # NOTE: published last.
        q[_WRITE_COUNT] = seq
        self._next = seq
        stats = self.stats
        stats.messages += 1
        stats.bytes += nbytes
        self._fence.full()  # NOTE: orders the seq store before the load of the reader's parked word.
        if i[_READER_PARKED]:
            self._bell_peer.ring()
            stats.doorbells += 1


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
        with view:
            data = bytes(view)
        self._hand_back(len(data))
        return data

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

    def acquire_read(self, timeout: float | None = None) -> "_ReadLease":
        """Lend the next validated payload without copying; the slot is handed back on exit.

        The message counts as consumed even if the block raises. The view must not outlive the block:
        a reference to the lent view still held at exit raises RingError and poisons the ring.
        Derived views (slices, numpy.frombuffer) cannot be tracked: copy what you keep.
        """
        return _ReadLease(self, self._acquire(timeout))

    def pending(self) -> int:
        """Messages published but not yet consumed (a snapshot)."""
        return self._q[L.OFF_WRITE_COUNT // 8] - self._next

    def _slot(self) -> int:
        return L.CTRL_BYTES + (self._next % self._num_slots) * self._slot_bytes

    def _published(self) -> bool:
        return self._q[(L.CTRL_BYTES + (self._next % self._num_slots) * self._slot_bytes) // 8] == self._next + 1

    def _acquire(self, timeout: float | None) -> memoryview:
        if self._closed or self._broken is not None:
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
        base = L.CTRL_BYTES + (self._next % self._num_slots) * self._slot_bytes
        q, i = self._q, self._i
        expect = self._next + 1
        if self._epoch == 0:
            self._epoch = q[L.OFF_EPOCH // 8]
        for attempt in range(_CONFIRM_TRIES):
            seq, epoch = q[base // 8], q[(base + L.SLOT_EPOCH) // 8]
            n, crc = i[(base + L.SLOT_LENGTH) // 4], i[(base + L.SLOT_CRC) // 4]
            if not IS_TSO:
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
                    if not IS_TSO:
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
        if not IS_TSO:
            self._fence.weak()  # NOTE: all payload loads are done before the slot is handed back.
        self._next += 1
        self._q[_READ_COUNT] = self._next
        stats = self.stats
        stats.messages += 1
        stats.bytes += nbytes
        self._fence.full()  # NOTE: orders the read_count store before the load of the writer's parked word.
        if self._i[_WRITER_PARKED]:
            self._bell_peer.ring()
            stats.doorbells += 1
        if escaped:
            self._broken = "a slot view escaped acquire_read"
            raise RingError("a view of the slot outlived acquire_read; the ring can no longer be trusted")


class _ReadLease:
    """The context of `acquire_read`: lends the validated view, hands the slot back on exit and
    refuses to trust the ring if the view outlived the block (a plain class: a generator-based
    context manager costs as much as the rest of a read)."""

    __slots__ = ("_reader", "_view", "_nbytes", "_refs")

    def __init__(self, reader: RingReader, view: memoryview):
        self._reader, self._view, self._nbytes = reader, view, view.nbytes

    def __enter__(self) -> memoryview:
        self._refs = _refcount(self._view)
        return self._view

    def __exit__(self, *exc: object) -> None:
        view, self._view = self._view, None
        kept = not _release(view, self._refs)  # the same count of holders as at __enter__: nothing escaped
        del view
        self._reader._hand_back(self._nbytes, escaped=kept)
