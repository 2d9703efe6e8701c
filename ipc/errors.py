"""Exceptions raised by the ipc package.

Every failure of a ring or of the codec is one of these types, so callers can tell a timeout (retry),
a closed or dead peer (recreate the ring), a corrupt slot (recreate the ring, count it) and a bad
message (reject it) apart without parsing text.
"""
from __future__ import annotations


class IpcError(Exception):
    """Base class of every ipc error."""


class RingError(IpcError):
    """A ring cannot be used as asked (bad name, wrong role, misuse, resumed ring)."""


class RingTimeout(RingError, TimeoutError):
    """A wait on a ring (data for a reader, space for a writer) ran past its timeout."""


class RingClosed(RingError):
    """The peer closed its end cleanly and nothing is left to read (or nobody will read)."""


class PeerDied(RingError):
    """The process at the other end exited without closing; the ring must be recreated."""


class CorruptSlot(RingError):
    """A slot failed validation (torn, stale epoch, bad length, bad CRC32C, bad sequence).

    The reader never returns such a slot. The ring is poisoned afterwards: every later call raises
    again, because a ring that produced a bad slot is never resumed, only recreated.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"corrupt ring slot ({reason}): {detail}")
        self.reason = reason


class MessageTooLarge(IpcError, ValueError):
    """A message does not fit where it must go; the message names both sizes."""


class DecodeError(IpcError, ValueError):
    """Bytes are not a valid encoded message (unknown tag, truncated, bad lengths, bad UTF-8)."""


class EncodeError(IpcError, ValueError):
    """A message cannot be encoded (a value out of its field's range)."""
