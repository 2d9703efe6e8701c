"""The prefill side's holds on blocks a decode server has yet to READ.

After a remote-decode prefill the request's blocks stay allocated under a lease (vLLM: 30 s).
The decode renews it with heartbeats while the request waits in its queue (`KVRenew`) and ends
it when it has read the blocks or gave up (`KVDone`). A lease nobody renews expires, and its
blocks are freed: a dead or partitioned decode costs at most one ttl of pool space. `max_hold_s`
caps how long renewals can keep a lease alive, so a decode that heartbeats forever but never
reads cannot pin blocks indefinitely.

Not thread-safe: the engine loop owns it (hold at hand-off, renew/release from notifications,
`expired()` once per step). The clock is injectable for tests; the expiry a client sees
(`remote_blocks_expiry_time`, unix seconds) is the caller's to derive from `remaining()`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Lease:
    blocks: Any  # whatever the caller must free (e.g. a BlockTable or per-group id lists)
    ttl_s: float
    expires_at: float
    deadline: float  # no renewal moves expires_at past this


class LeaseTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_hold_s: float = 480.0):
        self.clock = clock
        self.max_hold_s = max_hold_s
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def held(self) -> list[tuple[str, Any]]:
        """Every live (request_id, blocks), oldest first."""
        return [(rid, lease.blocks) for rid, lease in self._leases.items()]

    def hold(self, request_id: str, blocks: Any, ttl_s: float) -> float:
        """Hold `blocks` for `request_id` for `ttl_s`; returns the expiry (clock time)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if request_id in self._leases:
            raise KeyError(f"request {request_id!r} already holds a lease")
        now = self.clock()
        deadline = now + max(ttl_s, self.max_hold_s)
        self._leases[request_id] = Lease(blocks, ttl_s, now + ttl_s, deadline)
        return now + ttl_s

    def renew(self, request_id: str) -> bool:
        """Extend a live lease by its ttl (capped at its deadline). False if unknown or already
        expired: its blocks are gone (or about to be freed) and the decode must not READ them."""
        lease = self._leases.get(request_id)
        now = self.clock()
        if lease is None or lease.expires_at <= now:
            return False
        lease.expires_at = min(now + lease.ttl_s, lease.deadline)
        return True

    def release(self, request_id: str) -> Any | None:
        """End a lease (the decode is done with it); its blocks, or None if there was none."""
        lease = self._leases.pop(request_id, None)
        return None if lease is None else lease.blocks

    def remaining(self, request_id: str) -> float:
        """Seconds until the lease expires (≤ 0 once it has)."""
        return self._leases[request_id].expires_at - self.clock()

    def expired(self, now: float | None = None) -> list[tuple[str, Any]]:
        """Remove and return every (request_id, blocks) whose lease ran out: free those blocks."""
        now = self.clock() if now is None else now
        gone = [rid for rid, lease in self._leases.items() if lease.expires_at <= now]
        return [(rid, self._leases.pop(rid).blocks) for rid in gone]

    def next_expiry(self) -> float | None:
        """Earliest expiry among live leases (to bound how long the loop may sleep)."""
        return min((lease.expires_at for lease in self._leases.values()), default=None)
