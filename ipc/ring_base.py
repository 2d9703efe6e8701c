"""What a ring's writer and reader share: mapping, role claim, waiting (spin, then park), closing.

Waiting: check, spin up to an adaptive budget (doubles after a wait that spinning won, halves after
one that had to park, within [spin_min_s, spin_max_s]), then park: set my ``parked`` word, full fence,
re-check, then sleep in ``select`` (or an asyncio reader) on my doorbell FIFO and the peer's pidfd,
for at most ``park_tick_s`` at a time and never past the deadline. The peer, after its own store that
could end my wait, does a full fence and reads my ``parked`` word; if set, it rings my doorbell.
With the fences, one of the two sees the other's store (Dekker), so no wake-up is lost; the tick is a
safety net, and a tick that finds the condition true with no doorbell following within a short grace
(the peer may be descheduled between its store and its ring) is counted as ``lost_wakeups``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import select
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

from ipc import ring_layout as L
from ipc.doorbell import Doorbell, Fence, PeerWatch
from ipc.errors import CorruptSlot, PeerDied, RingClosed, RingError, RingTimeout
from ipc.segment import Segment, fifo_paths

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RingStats:
    """Counters of one endpoint (not shared memory; each process counts its own side)."""

    messages: int = 0
    bytes: int = 0
    spin_wins: int = 0  # waits satisfied while spinning
    parks: int = 0  # waits that went to sleep
    doorbells: int = 0  # times this end woke the peer
    lost_wakeups: int = 0  # ticks that found work without a doorbell (should stay 0)
    corrupt: int = 0  # slots rejected


class RingEndpoint:
    """One end of a ring. Subclasses set the role offsets. Use from one thread only."""

    ROLE = ""
    PEER_ROLE = ""
    OFF_PID = OFF_PEER_PID = OFF_PARKED = OFF_PEER_PARKED = OFF_CLOSED = OFF_PEER_CLOSED = 0
    MY_FIFO = 0  # index into fifo_paths(): 0 = ".rd" (reader waits on it), 1 = ".wr"

    def __init__(self, seg: Segment, config: L.RingConfig) -> None:
        self._seg = seg
        self._mv = memoryview(seg.buf)
        self._q = self._mv.cast("Q")
        self._i = self._mv.cast("I")
        self.config = self._read_geometry(config)
        # Geometry as plain attributes: the hot paths read them on every message.
        self._num_slots, self._slot_bytes = self.config.num_slots, self.config.slot_bytes
        self._payload_bytes = self.config.payload_bytes
        self.name = seg.name
        paths = fifo_paths(seg.name)
        self._bell_mine = Doorbell(paths[self.MY_FIFO])
        self._bell_peer = Doorbell(paths[1 - self.MY_FIFO])
        self._fence = Fence()
        self._peer: PeerWatch | None = None
        self._spin_ns = int(self.config.spin_max_s * 1e9)
        self._broken: str | None = None
        self._closed = False
        self._registered_loop: asyncio.AbstractEventLoop | None = None  # see _loop_event
        self._registered_fds: list[int] = []
        self._loop_wake: asyncio.Event | None = None
        self._next = 0  # index of the next message this end writes or reads
        self.stats = RingStats()
        self._finalizer = weakref.finalize(self, Segment.unlink, seg) if seg.owner else None
        self._claim()

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, config: L.RingConfig | None = None) -> "RingEndpoint":
        """Create a new ring segment owned by this endpoint (it unlinks the segment on close)."""
        config = config or L.RingConfig()
        seg = Segment.create(config.segment_bytes)
        q, i = memoryview(seg.buf).cast("Q"), memoryview(seg.buf).cast("I")
        i[L.OFF_VERSION // 4] = L.VERSION
        i[L.OFF_SLOT_BYTES // 4] = config.slot_bytes
        i[L.OFF_NUM_SLOTS // 4] = config.num_slots
        q[L.OFF_MAGIC // 8] = L.MAGIC
        q.release(), i.release()
        return cls(seg, config)

    @classmethod
    def attach(cls, name: str, config: L.RingConfig | None = None) -> "RingEndpoint":
        """Attach to an existing ring by name; geometry comes from the segment, timing from config."""
        return cls(Segment.attach(name), config or L.RingConfig())

    def _read_geometry(self, config: L.RingConfig) -> L.RingConfig:
        i = self._i
        if self._seg.size < L.CTRL_BYTES or self._q[L.OFF_MAGIC // 8] != L.MAGIC:
            raise RingError(f"segment {self._seg.name} is not a ring (bad magic)")
        if i[L.OFF_VERSION // 4] != L.VERSION:
            raise RingError(f"ring layout version {i[L.OFF_VERSION // 4]}, expected {L.VERSION}")
        geometry = replace(config, slot_bytes=i[L.OFF_SLOT_BYTES // 4], num_slots=i[L.OFF_NUM_SLOTS // 4])
        if geometry.segment_bytes != self._seg.size:
            raise RingError(f"ring geometry {geometry} does not match segment size {self._seg.size}")
        return geometry

    def _claim(self) -> None:
        """Record this process as the ring's only {writer|reader}. A role is claimed once, ever."""
        owner_pid = self._i[self.OFF_PID // 4]
        if owner_pid != 0:
            self._close_local()
            raise RingError(
                f"ring {self.name} already had a {self.ROLE} (pid {owner_pid}); rings are never "
                "resumed: recreate it"
            )
        self._i[self.OFF_PID // 4] = os.getpid()

    # ---- waiting --------------------------------------------------------------------------------
    def _deadline(self, timeout: float | None) -> tuple[int, float]:
        t = self.config.timeout_s if timeout is None else timeout
        return time.perf_counter_ns() + int(t * 1e9), t

    def _wait(self, ready: Callable[[], bool], deadline_ns: int, what: str, timeout: float) -> None:
        if ready():
            return
        end = time.perf_counter_ns() + self._spin_ns
        n = 0
        while True:
            if ready():
                self._spin_ns = min(int(self.config.spin_max_s * 1e9), self._spin_ns * 2 + 1)
                self.stats.spin_wins += 1
                return
            n += 1
            if n & 3 == 0:
                if time.perf_counter_ns() >= end:
                    break
                os.sched_yield()
        self._spin_ns = max(int(self.config.spin_min_s * 1e9), self._spin_ns // 2)
        self._park(ready, deadline_ns, what, timeout)

    def _park(self, ready: Callable[[], bool], deadline_ns: int, what: str, timeout: float) -> None:
        self.stats.parks += 1
        bell = self._bell_mine.fileno()
        try:
            while True:
                if self._armed_and_ready(ready, deadline_ns, what, timeout):
                    return
                fds = [bell]
                peer_fd = self._peer.fileno() if self._peer else None
                if peer_fd is not None:
                    fds.append(peer_fd)
                wait_s = min((deadline_ns - time.perf_counter_ns()) / 1e9, self.config.park_tick_s)
                readable, _, _ = select.select(fds, [], [], max(wait_s, 0.0))
                if bell in readable:
                    self._bell_mine.drain()
                    if ready():  # the common wake-up: no need to re-arm first
                        return
                elif not readable and ready():
                    if not self._doorbell_follows():
                        self._note_lost_wakeup()
                    return
        finally:
            self._i[self.OFF_PARKED // 4] = 0

    async def _park_async(self, ready: Callable[[], bool], deadline_ns: int, what: str, timeout: float) -> None:
        """Like _park, on the running event loop. The doorbell and the peer's pidfd stay registered
        with the loop between waits (re-registering costs syscalls every time an end parks)."""
        self.stats.parks += 1
        loop = asyncio.get_running_loop()
        event = self._loop_event(loop)
        try:
            while True:
                event.clear()
                if self._armed_and_ready(ready, deadline_ns, what, timeout):
                    return
                wait_s = min((deadline_ns - time.perf_counter_ns()) / 1e9, self.config.park_tick_s)
                try:
                    # asyncio.timeout, not wait_for: Python 3.11's wait_for returns normally when its
                    # wait ends in the same loop pass as a cancel of this task, swallowing the cancel
                    # (a relay task cancelled at shutdown then parked again forever)
                    async with asyncio.timeout(max(wait_s, 0.0)):
                        await event.wait()
                except TimeoutError:
                    if ready():
                        if not (event.is_set() or self._doorbell_follows()):
                            self._note_lost_wakeup()
                        return
                    continue
                if ready():
                    return
        finally:
            self._i[self.OFF_PARKED // 4] = 0

    def _loop_event(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        """The event the doorbell (and the peer's exit) sets, registered once with `loop`."""
        if self._registered_loop is not loop:
            self._unregister_loop()
            event = asyncio.Event()

            def on_readable() -> None:
                self._bell_mine.drain()
                event.set()

            self._registered_fds = [self._bell_mine.fileno()]
            if self._peer is None:
                self._watch_peer()
            if self._peer is not None and self._peer.fileno() is not None:
                self._registered_fds.append(self._peer.fileno())
            for fd in self._registered_fds:
                loop.add_reader(fd, on_readable)
            self._registered_loop, self._loop_wake = loop, event
        return self._loop_wake

    def _unregister_loop(self) -> None:
        loop, self._registered_loop = self._registered_loop, None
        if loop is not None and not loop.is_closed():
            for fd in self._registered_fds:
                loop.remove_reader(fd)
        self._registered_fds = []

    def _armed_and_ready(self, ready: Callable[[], bool], deadline_ns: int, what: str, timeout: float) -> bool:
        """Set ``parked``, fence, re-check; raise if the peer is gone or the deadline passed."""
        self._i[self.OFF_PARKED // 4] = 1
        self._fence.full()  # NOTE: orders the parked store before the re-check load (Dekker).
        if ready():
            return True
        self._check_peer(ready)
        if time.perf_counter_ns() >= deadline_ns:
            raise RingTimeout(f"ring {self.name}: {self.ROLE} waited {timeout:g} s for {what}")
        return False

    def _check_peer(self, ready: Callable[[], bool]) -> None:
        """Raise RingClosed / PeerDied if the peer is gone and the awaited condition is still false."""
        self._check_epoch()
        if self._i[self.OFF_PEER_CLOSED // 4]:
            if ready():
                return
            raise RingClosed(f"ring {self.name}: the {self.PEER_ROLE} closed its end")
        if self._peer is None and not self._watch_peer():
            return  # peer not attached yet: only the timeout applies
        if not self._peer.alive() and not ready():
            self._broken = f"{self.PEER_ROLE} pid {self._peer.pid} died"
            raise PeerDied(
                f"ring {self.name}: the {self.PEER_ROLE} (pid {self._peer.pid}) exited without "
                "closing; recreate the ring"
            )

    def _watch_peer(self) -> bool:
        """Start watching the peer process once it has attached; False if it has not yet."""
        pid = self._i[self.OFF_PEER_PID // 4]
        if pid == 0:
            return False
        self._peer = PeerWatch(pid)
        return True

    def _check_epoch(self) -> None:
        """Overridden by the reader: the writer's epoch must never change."""

    def _doorbell_follows(self, grace_s: float = 0.05) -> bool:
        """After a tick found work: did the peer ring after all (it may have been descheduled
        between its store and its doorbell)? Only a doorbell that never comes is a lost wake-up."""
        bell = self._bell_mine.fileno()
        readable, _, _ = select.select([bell], [], [], grace_s)
        if readable and self._registered_loop is None:
            self._bell_mine.drain()  # the loop's reader drains it when one is registered
        return bool(readable)

    def _note_lost_wakeup(self) -> None:
        self.stats.lost_wakeups += 1
        logger.warning("ring %s: %s found work on a tick without a doorbell", self.name, self.ROLE)

    def _ring_peer_if_parked(self) -> None:
        """Call after a store that can end the peer's wait."""
        self._fence.full()  # NOTE: orders that store before the load of the peer's parked word.
        if self._i[self.OFF_PEER_PARKED // 4]:
            self._bell_peer.ring()
            self.stats.doorbells += 1

    def _check_usable(self) -> None:
        if self._closed:
            raise RingError(f"ring {self.name}: this {self.ROLE} end is closed")
        if self._broken is not None:
            raise RingError(f"ring {self.name} is unusable ({self._broken}); recreate it")

    def _poison(self, reason: str, detail: str) -> CorruptSlot:
        self._broken = f"corrupt slot: {reason}"
        self.stats.corrupt += 1
        logger.error("ring %s: rejected slot (%s): %s", self.name, reason, detail)
        return CorruptSlot(reason, f"ring {self.name}: {detail}")

    # ---- lifetime -------------------------------------------------------------------------------
    @property
    def is_owner(self) -> bool:
        return self._seg.owner

    def close(self) -> None:
        """Mark this end closed, wake the peer, unmap; the owner also unlinks the segment."""
        if self._closed:
            return
        self._i[self.OFF_CLOSED // 4] = 1
        self._fence.full()
        self._bell_peer.ring()
        self._close_local()

    def _close_local(self) -> None:
        self._closed = True
        self._unregister_loop()
        self._bell_mine.close()
        self._bell_peer.close()
        if self._peer is not None:
            self._peer.close()
        for view in (self._q, self._i, self._mv):
            view.release()
        try:
            self._seg.close()
        except BufferError:
            logger.error("ring %s: a view of the segment is still alive; leaving it mapped", self.name)
        if self._finalizer is not None:
            self._finalizer()

    def recreate(self) -> "RingEndpoint":
        """Close (and unlink) this ring and create a fresh one with the same geometry and role.

        Only the owner may do this. The new ring has a new name and epoch; the peer must attach anew.
        """
        if not self.is_owner:
            raise RingError(f"ring {self.name}: only the owner can recreate it")
        config = self.config
        self.close()
        return type(self).create(config)

    def __enter__(self) -> "RingEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} next={self._next} owner={self.is_owner}>"
