"""One READ's state machine, the same for every transport: 'pending' until the data plane
reports it done; a data-plane error, an 'ERR' status or the deadline makes it 'failed'
(`TransferFailed`), and for those the transport drops the peer, so that no byte of it can land
later. The blocks it writes are usable only once it is 'done'."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .transport import TransferFailed

if TYPE_CHECKING:
    from .peer_transport import PeerTransport


class Transfer:
    """One READ in flight. `poll()` → 'pending' | 'done', or raises TransferFailed."""

    def __init__(self, transport: "PeerTransport", peer: str, handle: Any, nbytes: int, timeout_s: float | None):
        self._transport, self.peer, self._handle, self.nbytes = transport, peer, handle, nbytes
        self.started = time.monotonic()
        self._deadline = None if timeout_s is None else self.started + timeout_s
        self.state = "pending"  # 'pending' | 'done' | 'failed'
        self.finished: float | None = None
        self._error: TransferFailed | None = None

    @classmethod
    def failed(cls, transport: "PeerTransport", peer: str, error: TransferFailed) -> "Transfer":
        t = cls(transport, peer, None, 0, None)
        t.state, t._error, t.finished = "failed", error, t.started
        return t

    @classmethod
    def empty(cls, transport: "PeerTransport", peer: str) -> "Transfer":
        """A READ of nothing: done at once."""
        t = cls(transport, peer, None, 0, None)
        t.state, t.finished = "done", t.started
        return t

    def poll(self) -> str:
        if self.state == "done":
            return "done"
        if self.state == "failed":
            raise self._error
        try:
            status = self._transport._read_state(self._handle)
        except Exception as exc:  # the peer disconnected (NIXL: nixlRemoteDisconnectError) and friends
            self._transport._transfer_failed(self, f"READ from {self.peer} failed: {type(exc).__name__}: {exc}",
                                             exc, drop_peer=True)
            raise self._error from None
        if status == "DONE":
            self._transport._transfer_done(self)
            return "done"
        if status == "ERR":
            self._transport._transfer_failed(self, f"READ from {self.peer} failed "
                                                   f"({self._transport.kind} status ERR)", "ERR", drop_peer=True)
            raise self._error
        if self._deadline is not None and time.monotonic() > self._deadline:
            # A peer that stops answering (SIGSTOP, partition) never errors out by itself: give
            # up, and disconnect it so that no byte of this READ can land later.
            self._transport._transfer_failed(self, f"READ from {self.peer} timed out after "
                                                   f"{self._deadline - self.started:.1f} s", "timeout", drop_peer=True)
            raise self._error
        return "pending"

    def wait(self, timeout_s: float | None = None, sleep_s: float = 0.001) -> None:
        """Poll until done (TransferFailed on failure, TimeoutError after `timeout_s`)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while self.poll() == "pending":
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"READ from {self.peer} still pending after {timeout_s} s")
            time.sleep(sleep_s)

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop a pending READ; later polls raise TransferFailed(reason)."""
        if self.state == "pending":
            self._transport._transfer_failed(self, f"READ from {self.peer} {reason}", reason, drop_peer=False)
