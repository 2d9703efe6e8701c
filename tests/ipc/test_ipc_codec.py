"""Codec: round trips of every message type (hypothesis), clean errors on hostile bytes, and the
one validation of values entering at an edge (`check`)."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc import codec
from ipc.codec import InvalidField, check
from ipc.errors import DecodeError, EncodeError, MessageTooLarge
from ipc.messages import (
    FINISH_REASONS,
    MESSAGE_TYPES,
    Abort,
    Finished,
    Heartbeat,
    Parked,
    SamplingParams,
    Shutdown,
    StepOutputs,
    Submit,
    TokenDelta,
    Wake,
    WorkerReady,
)
from ipc.ring import RingConfig, RingReader, RingWriter

count = st.integers(0, 2**63 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
token = st.integers(0, 2**31 - 1)
f64 = st.floats(allow_nan=False)
seconds = st.floats(min_value=0.0, allow_nan=False)
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)  # no lone surrogates
tokens = st.lists(token, max_size=50)

params = st.builds(
    SamplingParams, max_tokens=st.integers(1, 2**31 - 1), temperature=st.floats(0.0, 1e4),
    top_p=st.floats(0.0, 1.0, exclude_min=True), top_k=st.integers(0, 2**31 - 1), min_p=st.floats(0.0, 1.0),
    presence_penalty=st.floats(-2.0, 2.0), frequency_penalty=st.floats(-2.0, 2.0), seed=st.none() | i64,
    logprobs=st.none() | st.integers(0, 20), stop_token_ids=st.lists(token, max_size=64).map(tuple),
    ignore_eos=st.booleans(),
)
top = st.lists(st.lists(st.tuples(st.integers(-(2**31), 2**31 - 1), f64), max_size=5), max_size=8)
delta = st.builds(TokenDelta, request_id=count, token_ids=tokens, logprobs=st.none() | st.lists(f64, max_size=20),
                  top_logprobs=st.none() | top)
finished = st.builds(Finished, request_id=count, reason=st.sampled_from(FINISH_REASONS), prompt_tokens=count,
                     completion_tokens=count, error=st.none() | text, error_code=st.integers(0, 599))
STRATEGIES = {
    Submit: st.builds(Submit, request_id=count, prompt_token_ids=tokens, params=params),
    Abort: st.builds(Abort, request_ids=st.lists(count, max_size=20)),
    Shutdown: st.builds(Shutdown, reason=text),
    Wake: st.builds(Wake, epoch=count),
    Parked: st.builds(Parked, epoch=count),
    StepOutputs: st.builds(StepOutputs, deltas=st.lists(delta, max_size=4), finished=st.lists(finished, max_size=4)),
    WorkerReady: st.builds(WorkerReady, rank=count, pid=count, num_kv_blocks=count, kv_block_size=count,
                           max_model_len=count, device=text),
    Heartbeat: st.builds(Heartbeat, rank=count, step=count, step_started_at=seconds, progress=count, num_running=count,
                         num_waiting=count, kv_blocks_used=count, kv_blocks_total=count, sent_at=seconds,
                         spec_accepted_per_position=st.lists(count, max_size=4)),
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
    assert msgspec.msgpack.decode(raw)[0] == cls.__struct_config__.tag  # a tagged array on the wire
    assert codec.decode(raw) == msg
    assert codec.decode(memoryview(bytearray(raw))) == msg
    assert check(msg) == msg  # every generated value is within its wire type's limits


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
    assert codec.decode(codec.encode(msg)) == msg  # whatever decodes is a well-formed message


@settings(max_examples=200, deadline=None)
@given(any_message, st.data())
def test_bit_flips_decode_or_fail_cleanly(msg, data):
    raw = bytearray(codec.encode(msg))
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    try:
        flipped = codec.decode(bytes(raw))
    except DecodeError:
        return
    # a flip that still decodes is still within every limit; compared encoded, since a flipped
    # exponent bit can make a float NaN, and NaN != NaN
    assert codec.encode(check(flipped)) == codec.encode(flipped)


def test_specific_garbage_errors():
    with pytest.raises(DecodeError, match="truncated"):
        codec.decode(b"")
    with pytest.raises(DecodeError, match="Invalid value 255"):
        codec.decode(msgspec.msgpack.encode([255, "x"]))  # unknown tag
    huge = b"\x94\x02\xdd\xff\xff\xff\xff"  # an Abort claiming 2**32 - 1 request ids
    with pytest.raises(DecodeError):
        codec.decode(huge)
    bad_utf8 = b"\x92\x03\xa2\xff\xfe"  # Shutdown with a 2-byte string that is not UTF-8
    with pytest.raises(DecodeError, match="(?i)utf-8"):
        codec.decode(bad_utf8)
    with pytest.raises(DecodeError, match="Expected `str`"):
        codec.decode(msgspec.msgpack.encode([3, 7]))  # a Shutdown whose reason is an int
    with pytest.raises(DecodeError):  # a Submit where only worker output belongs
        codec.decode(codec.encode(Submit(1, [1], SamplingParams())), "from_worker")


@pytest.mark.parametrize("bad", [[2**31], [-1], [1.5], ["7"]])
def test_out_of_range_tokens_are_refused_by_name(bad):
    msg = TokenDelta(1, bad)
    with pytest.raises(InvalidField) as refused:
        check(msg)
    assert refused.value.field == "token_ids"
    with pytest.raises(DecodeError):  # and a worker reading it off a ring refuses it cleanly
        codec.decode(codec.encode(StepOutputs([msg], [])))


def test_bad_scalars_are_refused_by_name_or_cannot_be_encoded():
    with pytest.raises(InvalidField) as refused:
        check(Abort(["1"]))  # type: ignore[list-item]
    assert refused.value.field == "request_ids"
    with pytest.raises(EncodeError, match="int"):
        codec.encode(Abort([2**64]))
    with pytest.raises(EncodeError, match="surrogates"):
        codec.encode(Shutdown("\ud800"))
    with pytest.raises(EncodeError, match="not an ipc message"):
        codec.encode(SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(InvalidField) as refused:
        check(Submit(1, [3], SamplingParams(seed=2**63)))
    assert refused.value.field == "params.seed"


def test_oversize_message_names_sizes():
    msg = Submit(1, list(range(1000)), SamplingParams())
    size = len(codec.encode(msg))
    with pytest.raises(MessageTooLarge, match=rf"{size} bytes, limit is 100 bytes"):
        codec.encode(msg, max_bytes=100)


def test_through_a_ring_zero_copy():
    reader = RingReader.create(RingConfig(slot_bytes=4096, num_slots=4))
    writer = RingWriter.attach(reader.name)
    try:
        msgs = [
            Submit(7, [1, 2, 3], SamplingParams(seed=1)),
            StepOutputs([TokenDelta(7, [4], [-0.5], [[(4, -0.5), (9, -2.0)]])], [Finished(7, "stop", 3, 1)]),
            Abort([7, 8]),
        ]
        for m in msgs:
            writer.put(codec.encode(m, max_bytes=writer.capacity))
        for m in msgs:
            with reader.acquire_read() as view:
                assert codec.decode(view) == m  # decode copies; the view can be handed back
    finally:
        writer.close()
        reader.close()
