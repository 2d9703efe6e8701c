"""Injected faults in a slot: torn payload, bit flips, stale epoch, bad length, bad sequence."""
from __future__ import annotations

import pytest

from ipc import ring_layout as L
from ipc.errors import CorruptSlot, RingError
from ipc.ring import RingConfig, RingReader, RingWriter
from ipc.segment import Segment

CONFIG = RingConfig(slot_bytes=256, num_slots=4, timeout_s=2.0)
MESSAGE = bytes(range(100))


@pytest.fixture
def rig():
    """A ring with one published message and a second, raw mapping of it for tampering."""
    reader = RingReader.create(CONFIG)
    writer = RingWriter.attach(reader.name)
    raw = Segment.attach(reader.name)
    writer.put(MESSAGE)
    yield writer, reader, raw.buf
    raw.close()
    writer.close()
    reader.close()


SLOT0 = L.CTRL_BYTES
PAYLOAD0 = SLOT0 + L.SLOT_HEADER_BYTES


def _expect_rejected(reader: RingReader, reason: str) -> None:
    with pytest.raises(CorruptSlot) as info:
        reader.get(timeout=1)
    assert info.value.reason == reason
    assert reader.stats.corrupt == 1
    with pytest.raises(RingError, match="recreate"):  # poisoned: never resumed
        reader.get(timeout=1)


@pytest.mark.parametrize("offset", [0, 1, 50, 99])
@pytest.mark.parametrize("bit", [0, 7])
def test_bit_flip_in_payload_is_rejected(rig, offset, bit):
    _, reader, buf = rig
    buf[PAYLOAD0 + offset] ^= 1 << bit
    _expect_rejected(reader, "crc")


def test_bit_flip_in_crc_is_rejected(rig):
    _, reader, buf = rig
    buf[SLOT0 + L.SLOT_CRC] ^= 0x10
    _expect_rejected(reader, "crc")


def test_torn_payload_is_rejected(rig):
    """Seq says published, but the second half of the payload is from another message."""
    _, reader, buf = rig
    buf[PAYLOAD0 + 50 : PAYLOAD0 + 100] = bytes(50)
    _expect_rejected(reader, "crc")


def test_length_beyond_capacity_is_rejected(rig):
    _, reader, buf = rig
    memoryview(buf).cast("I")[(SLOT0 + L.SLOT_LENGTH) // 4] = CONFIG.payload_bytes + 1
    _expect_rejected(reader, "length")


def test_shortened_length_is_rejected(rig):
    _, reader, buf = rig
    memoryview(buf).cast("I")[(SLOT0 + L.SLOT_LENGTH) // 4] = 99
    _expect_rejected(reader, "crc")


def test_stale_epoch_slot_is_rejected(rig):
    """A slot with a valid CRC written under another writer's epoch is refused."""
    _, reader, buf = rig
    q, i = memoryview(buf).cast("Q"), memoryview(buf).cast("I")
    stale = q[L.OFF_EPOCH // 8] ^ 0xDEADBEEF
    payload = memoryview(buf)[PAYLOAD0 : PAYLOAD0 + len(MESSAGE)]
    q[(SLOT0 + L.SLOT_EPOCH) // 8] = stale
    i[(SLOT0 + L.SLOT_CRC) // 4] = L.slot_crc(1, stale, len(MESSAGE), payload)
    payload.release(), q.release(), i.release()
    _expect_rejected(reader, "stale epoch")


def test_unexpected_sequence_is_rejected(rig):
    _, reader, buf = rig
    memoryview(buf).cast("Q")[SLOT0 // 8] = 12345
    _expect_rejected(reader, "sequence")


def test_changed_writer_epoch_is_refused(rig):
    writer, reader, buf = rig
    assert reader.get() == MESSAGE
    memoryview(buf).cast("Q")[L.OFF_EPOCH // 8] ^= 1 << 40
    with pytest.raises(RingError, match="epoch changed"):
        reader.get(timeout=0.5)


def test_untouched_slot_passes(rig):
    _, reader, _ = rig
    assert reader.get() == MESSAGE and reader.stats.corrupt == 0
