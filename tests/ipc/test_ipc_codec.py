"""Codec: round trips of every message type (hypothesis), and clear errors on bad input."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc import codec
from ipc.errors import DecodeError, EncodeError, MessageTooLarge
from ipc.messages import (
    MESSAGE_TYPES,
    Abort,
    Error,
    Finished,
    Heartbeat,
    SamplingParamsMsg,
    Shutdown,
    Submit,
    TokenDelta,
    WorkerReady,
)
from ipc.ring import RingConfig, RingReader, RingWriter

i64 = st.integers(-(2**63), 2**63 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
f64 = st.floats(allow_nan=False)
text = st.text(max_size=40)
tokens = st.lists(i32, max_size=50)

params = st.builds(
    SamplingParamsMsg, max_tokens=i64, temperature=f64, top_p=f64, top_k=i64, min_p=f64,
    presence_penalty=f64, frequency_penalty=f64, seed=st.none() | i64, stop_token_ids=tokens,
    ignore_eos=st.booleans(), logprobs=st.none() | i64, session_id=st.none() | text,
)
top = st.lists(st.lists(st.tuples(i32, f64), max_size=5), max_size=8)
STRATEGIES = {
    Submit: st.builds(Submit, request_id=i64, prompt_token_ids=tokens, params=params),
    Abort: st.builds(Abort, request_id=i64),
    TokenDelta: st.builds(
        TokenDelta, request_id=i64, token_ids=tokens,
        logprobs=st.none() | st.lists(f64, max_size=20), top_logprobs=st.none() | top,
    ),
    Finished: st.builds(Finished, request_id=i64, reason=text, prompt_tokens=i64, completion_tokens=i64),
    Error: st.builds(Error, request_id=i64, message=text, code=i64),
    WorkerReady: st.builds(
        WorkerReady, rank=i64, pid=i64, num_kv_blocks=i64, kv_block_size=i64, max_model_len=i64, device=text
    ),
    Heartbeat: st.builds(
        Heartbeat, rank=i64, step=i64, step_started_at=f64, num_running=i64, num_waiting=i64,
        kv_blocks_used=i64, kv_blocks_total=i64, sent_at=f64,
    ),
    Shutdown: st.builds(Shutdown, reason=text),
}
any_message = st.one_of(*STRATEGIES.values())


def test_every_message_type_has_a_strategy():
    assert set(STRATEGIES) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_round_trip(cls, data):
    msg = data.draw(STRATEGIES[cls])
    raw = codec.encode(msg)
    assert raw[0] == cls.TAG
    assert codec.decode(raw) == msg
    assert codec.decode(memoryview(bytearray(raw))) == msg


@settings(max_examples=60, deadline=None)
@given(any_message)
def test_every_truncation_is_a_decode_error(msg):
    raw = codec.encode(msg)
    for cut in range(len(raw)):
        with pytest.raises(DecodeError):
            codec.decode(raw[:cut])


@settings(max_examples=60, deadline=None)
@given(any_message, st.binary(min_size=1, max_size=8))
def test_trailing_bytes_are_a_decode_error(msg, extra):
    with pytest.raises(DecodeError, match="trailing"):
        codec.decode(codec.encode(msg) + extra)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_never_crashes(raw):
    try:
        msg = codec.decode(raw)
    except DecodeError:
        return
    assert codec.encode(msg) == raw  # whatever decodes must be a canonical encoding


@settings(max_examples=200, deadline=None)
@given(any_message, st.data())
def test_bit_flips_decode_or_fail_cleanly(msg, data):
    raw = bytearray(codec.encode(msg))
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    try:
        codec.decode(bytes(raw))
    except DecodeError:
        pass


def test_specific_garbage_errors():
    with pytest.raises(DecodeError, match="empty"):
        codec.decode(b"")
    with pytest.raises(DecodeError, match="unknown message tag 255"):
        codec.decode(b"\xff")
    huge = bytes([TokenDelta.TAG]) + struct.pack("<qI", 1, 2**32 - 1)
    with pytest.raises(DecodeError, match="count 4294967295"):
        codec.decode(huge)
    bad_flag = codec.encode(Submit(1, [], SamplingParamsMsg()))
    flag_at = 1 + 8 + 4 + 8 * 7  # tag, request_id, empty tokens, seven scalars -> seed flag
    with pytest.raises(DecodeError, match="flag byte"):
        codec.decode(bad_flag[:flag_at] + b"\x07" + bad_flag[flag_at + 1 :])
    bad_utf8 = bytes([Shutdown.TAG]) + struct.pack("<I", 2) + b"\xff\xfe"
    with pytest.raises(DecodeError, match="UTF-8"):
        codec.decode(bad_utf8)


@pytest.mark.parametrize("bad", [[2**31], [-(2**31) - 1], [1.5], ["7"]])
def test_out_of_range_tokens_are_an_encode_error(bad):
    with pytest.raises(EncodeError, match="TokenDelta.token_ids"):
        codec.encode(TokenDelta(1, bad))


def test_bad_scalar_types_are_an_encode_error():
    with pytest.raises(EncodeError, match="Abort.request_id"):
        codec.encode(Abort("1"))  # type: ignore[arg-type]
    with pytest.raises(EncodeError, match="request_id"):
        codec.encode(Abort(2**64))
    with pytest.raises(EncodeError, match="not an ipc message"):
        codec.encode(SamplingParamsMsg())  # type: ignore[arg-type]


def test_oversize_message_names_sizes():
    msg = Submit(1, list(range(1000)), SamplingParamsMsg())
    size = len(codec.encode(msg))
    with pytest.raises(MessageTooLarge, match=rf"{size} bytes, limit is 100 bytes"):
        codec.encode(msg, max_bytes=100)


def test_through_a_ring_zero_copy():
    reader = RingReader.create(RingConfig(slot_bytes=4096, num_slots=4))
    writer = RingWriter.attach(reader.name)
    try:
        msgs = [
            Submit(7, [1, 2, 3], SamplingParamsMsg(seed=1, session_id="s")),
            TokenDelta(7, [4], [-0.5], [[(4, -0.5), (9, -2.0)]]),
            Finished(7, "stop", 3, 1),
        ]
        for m in msgs:
            writer.put(codec.encode(m, max_bytes=writer.capacity))
        for m in msgs:
            with reader.acquire_read() as view:
                assert codec.decode(view) == m  # decode copies; the view can be handed back
    finally:
        writer.close()
        reader.close()
