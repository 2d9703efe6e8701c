"""Byte layout of a ring segment, its configuration, and the slot checksum (see ipc.ring for the picture).

All header words are native-endian and naturally aligned, and are read and written through
``memoryview.cast('Q')``/``cast('I')`` item access, which CPython performs as one ``memcpy`` of 8 or 4
bytes (a single aligned load/store on x86-64 and AArch64), so a peer never sees half a word.
(``struct.pack_into('<Q', ...)`` would be wrong here: it stores byte by byte.)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c

MAGIC = int.from_bytes(b"RSRING01", "little")
VERSION = 1
CTRL_BYTES = 256  # four 64-byte lines: geometry/identity, writer line, reader line, spare
SLOT_HEADER_BYTES = 32
SEQ_BUSY = (1 << 64) - 1  # slot is being rewritten by the writer

# Control block, byte offsets. Index into cast('Q') with off // 8, into cast('I') with off // 4.
OFF_MAGIC = 0  # u64
OFF_VERSION = 8  # u32
OFF_SLOT_BYTES = 12  # u32
OFF_NUM_SLOTS = 16  # u32
OFF_WRITER_PID = 24  # u32, set once when the writer attaches
OFF_READER_PID = 28  # u32, set once when the reader attaches
OFF_EPOCH = 32  # u64, random, set once by the writer; 0 until then
OFF_WRITE_COUNT = 64  # u64, writer line: messages published
OFF_WRITER_PARKED = 72  # u32, writer is (about to be) asleep waiting for space
OFF_WRITER_CLOSED = 76  # u32, writer closed cleanly
OFF_READ_COUNT = 128  # u64, reader line: messages consumed (slots handed back)
OFF_READER_PARKED = 136  # u32, reader is (about to be) asleep waiting for data
OFF_READER_CLOSED = 140  # u32, reader closed cleanly

# Slot header, byte offsets from the slot start.
SLOT_SEQ = 0  # u64, published last: message index + 1, or SEQ_BUSY, or 0 (never written)
SLOT_EPOCH = 8  # u64, epoch of the writer that wrote the slot
SLOT_LENGTH = 16  # u32, payload bytes
SLOT_CRC = 20  # u32, CRC32C of (seq, epoch, length) as '<QQI' followed by the payload

_CRC_HEADER = struct.Struct("<QQI")


def slot_crc(seq: int, epoch: int, length: int, payload: memoryview) -> int:
    """CRC32C over the slot's identity fields and payload; a flip anywhere in them changes it."""
    return crc32c.crc32c(payload, crc32c.crc32c(_CRC_HEADER.pack(seq, epoch, length)))


@dataclass(frozen=True, slots=True)
class RingConfig:
    """Geometry and timing of a ring. Geometry is stored in the segment; timing is per endpoint.

    Invariants: ``slot_bytes`` is a multiple of 64 and larger than the 32-byte slot header;
    ``num_slots`` >= 2; every wait is bounded (``timeout_s`` is finite and positive).
    """

    slot_bytes: int = 1 << 20  # header included; payload capacity is slot_bytes - 32
    num_slots: int = 16
    timeout_s: float = 30.0  # default bound of every wait
    spin_min_s: float = 2e-6  # adaptive spin before parking, lower bound
    spin_max_s: float = 100e-6  # adaptive spin before parking, upper bound
    park_tick_s: float = 0.1  # a parked end re-checks at least this often (safety net)

    def __post_init__(self) -> None:
        if self.slot_bytes % 64 or self.slot_bytes <= SLOT_HEADER_BYTES or self.slot_bytes >= 1 << 32:
            raise ValueError(f"slot_bytes must be a multiple of 64 in (32, 2**32), got {self.slot_bytes}")
        if not 2 <= self.num_slots < 1 << 31:
            raise ValueError(f"num_slots must be >= 2, got {self.num_slots}")
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be finite and positive, got {self.timeout_s}")
        if not 0 <= self.spin_min_s <= self.spin_max_s:
            raise ValueError("need 0 <= spin_min_s <= spin_max_s")
        if not 0 < self.park_tick_s:
            raise ValueError("park_tick_s must be positive")

    @property
    def payload_bytes(self) -> int:
        return self.slot_bytes - SLOT_HEADER_BYTES

    @property
    def segment_bytes(self) -> int:
        return CTRL_BYTES + self.num_slots * self.slot_bytes
