"""Explicit binary encoding of ``ipc.messages``: ``encode(msg) -> bytes``, ``decode(buf) -> msg``.

Format: one tag byte, then the message's fields in declaration order (the schema below), all
little-endian: i64 as '<q', f64 as '<d', bool as one byte 0/1, an optional field as a presence byte
0/1 followed by the value, str as u32 byte length + UTF-8, token arrays as u32 count + int32 values
(read with numpy.frombuffer), float arrays as u32 count + f64 values, top-logprobs as u32 token count,
that many u32 per-token counts, then all token ids (int32) and all logprobs (f64). Nested
SamplingParamsMsg fields are inlined.

Decoding validates the tag, every presence/bool byte, every count against the bytes that remain
(before allocating), UTF-8, and that no bytes trail; any failure is a DecodeError, never a crash.
``decode`` copies what it needs, so it is safe on a ring slot's memoryview.
"""
from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from ipc.errors import DecodeError, EncodeError, MessageTooLarge
from ipc.messages import (
    MESSAGE_TYPES,
    Abort,
    Error,
    Finished,
    Heartbeat,
    Message,
    SamplingParamsMsg,
    Shutdown,
    Submit,
    TokenDelta,
    WorkerReady,
)

_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_U32 = struct.Struct("<I")
_I32_LE = np.dtype("<i4")
_F64_LE = np.dtype("<f8")
_U32_LE = np.dtype("<u4")
_LITTLE = sys.byteorder == "little" and array("i").itemsize == 4
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1

_SCHEMA: dict[type, tuple[tuple[str, str], ...]] = {
    SamplingParamsMsg: (
        ("max_tokens", "i64"), ("temperature", "f64"), ("top_p", "f64"), ("top_k", "i64"),
        ("min_p", "f64"), ("presence_penalty", "f64"), ("frequency_penalty", "f64"),
        ("seed", "opt_i64"), ("stop_token_ids", "i32s"), ("ignore_eos", "bool"),
        ("logprobs", "opt_i64"), ("session_id", "opt_str"),
    ),
    Submit: (("request_id", "i64"), ("prompt_token_ids", "i32s"), ("params", "params")),
    Abort: (("request_id", "i64"),),
    TokenDelta: (
        ("request_id", "i64"), ("token_ids", "i32s"), ("logprobs", "opt_f64s"), ("top_logprobs", "opt_top"),
    ),
    Finished: (("request_id", "i64"), ("reason", "str"), ("prompt_tokens", "i64"), ("completion_tokens", "i64")),
    Error: (("request_id", "i64"), ("message", "str"), ("code", "i64")),
    WorkerReady: (
        ("rank", "i64"), ("pid", "i64"), ("num_kv_blocks", "i64"), ("kv_block_size", "i64"),
        ("max_model_len", "i64"), ("device", "str"),
    ),
    Heartbeat: (
        ("rank", "i64"), ("step", "i64"), ("step_started_at", "f64"), ("num_running", "i64"),
        ("num_waiting", "i64"), ("kv_blocks_used", "i64"), ("kv_blocks_total", "i64"), ("sent_at", "f64"),
        ("num_preemptions", "i64"), ("spec_drafts", "i64"), ("spec_draft_tokens", "i64"),
        ("spec_accepted_per_position", "i32s"), ("loop_pause_max_s", "f64"),
    ),
    Shutdown: (("reason", "str"),),
}
_BY_TAG: dict[int, type] = {t.TAG: t for t in MESSAGE_TYPES}
assert set(_SCHEMA) == {*MESSAGE_TYPES, SamplingParamsMsg}


# ---- encoding ---------------------------------------------------------------------------------
def encode(msg: Message, max_bytes: int | None = None) -> bytes:
    """Encode ``msg``; raise EncodeError on an out-of-range value, MessageTooLarge past ``max_bytes``."""
    cls = type(msg)
    if cls not in _BY_TAG.values():
        raise EncodeError(f"not an ipc message: {cls.__name__}")
    parts: list[bytes] = [bytes((cls.TAG,))]
    _encode_fields(msg, parts)
    data = b"".join(parts)
    if max_bytes is not None and len(data) > max_bytes:
        raise MessageTooLarge(f"encoded {cls.__name__} is {len(data)} bytes, limit is {max_bytes} bytes")
    return data


def _encode_fields(obj: Any, parts: list[bytes]) -> None:
    for name, kind in _SCHEMA[type(obj)]:
        value = getattr(obj, name)
        try:
            _ENCODERS[kind](value, parts)
        except EncodeError as e:
            raise EncodeError(f"{type(obj).__name__}.{name}: {e}") from None
        except (struct.error, TypeError, ValueError, OverflowError) as e:
            raise EncodeError(f"{type(obj).__name__}.{name}: cannot encode {value!r:.80} as {kind}: {e}") from None


def _enc_i64(v: int, parts: list[bytes]) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise EncodeError(f"expected int, got {type(v).__name__}")
    parts.append(_I64.pack(v))


def _enc_f64(v: float, parts: list[bytes]) -> None:
    if not isinstance(v, (int, float, np.floating)) or isinstance(v, bool):
        raise EncodeError(f"expected float, got {type(v).__name__}")
    parts.append(_F64.pack(v))


def _enc_bool(v: bool, parts: list[bytes]) -> None:
    if not isinstance(v, (bool, np.bool_)):
        raise EncodeError(f"expected bool, got {type(v).__name__}")
    parts.append(b"\x01" if v else b"\x00")


def _enc_str(v: str, parts: list[bytes]) -> None:
    if not isinstance(v, str):
        raise EncodeError(f"expected str, got {type(v).__name__}")
    raw = v.encode("utf-8")
    parts.append(_U32.pack(len(raw)))
    parts.append(raw)


def _int32_array(values: Any) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, _I32_LE)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise EncodeError(f"expected a flat list of ints, got dtype {arr.dtype} shape {arr.shape}")
    if int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX:
        raise EncodeError("token id outside int32 range")
    return arr.astype(_I32_LE, copy=False)


def _enc_i32s(v: list[int], parts: list[bytes]) -> None:
    if _LITTLE and isinstance(v, list):
        try:  # fast path: array('i') range-checks each int and refuses non-ints
            raw = array("i", v).tobytes()
        except (TypeError, OverflowError) as e:
            raise EncodeError(f"token ids must be int32: {e}") from None
        parts.append(_U32.pack(len(v)))
        parts.append(raw)
        return
    arr = _int32_array(v)
    parts.append(_U32.pack(arr.size))
    parts.append(arr.tobytes())


def _float_array(values: Any) -> np.ndarray:
    arr = np.asarray(values, dtype=_F64_LE) if len(values) else np.zeros(0, _F64_LE)
    if arr.ndim != 1:
        raise EncodeError(f"expected a flat list of floats, got shape {arr.shape}")
    return arr


def _enc_f64s(v: list[float], parts: list[bytes]) -> None:
    arr = _float_array(v)
    parts.append(_U32.pack(arr.size))
    parts.append(arr.tobytes())


def _enc_top(v: list[list[tuple[int, float]]], parts: list[bytes]) -> None:
    counts = np.fromiter((len(row) for row in v), dtype=_U32_LE, count=len(v))
    ids = _int32_array([tok for row in v for tok, _ in row])
    lps = _float_array([lp for row in v for _, lp in row])
    parts += (_U32.pack(len(v)), counts.tobytes(), ids.tobytes(), lps.tobytes())


def _optional(enc: Callable[[Any, list[bytes]], None]) -> Callable[[Any, list[bytes]], None]:
    def encode_optional(v: Any, parts: list[bytes]) -> None:
        if v is None:
            parts.append(b"\x00")
        else:
            parts.append(b"\x01")
            enc(v, parts)

    return encode_optional


_ENCODERS: dict[str, Callable[[Any, list[bytes]], None]] = {
    "i64": _enc_i64, "f64": _enc_f64, "bool": _enc_bool, "str": _enc_str, "i32s": _enc_i32s,
    "opt_i64": _optional(_enc_i64), "opt_str": _optional(_enc_str), "opt_f64s": _optional(_enc_f64s),
    "opt_top": _optional(_enc_top), "params": lambda v, parts: _encode_params(v, parts),
}


def _encode_params(v: SamplingParamsMsg, parts: list[bytes]) -> None:
    if not isinstance(v, SamplingParamsMsg):
        raise EncodeError(f"expected SamplingParamsMsg, got {type(v).__name__}")
    _encode_fields(v, parts)


# ---- decoding ---------------------------------------------------------------------------------
class _Reader:
    """Cursor over a buffer; every read checks bounds first and raises DecodeError."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise DecodeError(f"truncated {what}: need {n} bytes at offset {self.pos}, have {len(self.buf) - self.pos}")
        view = self.buf[self.pos : end]
        self.pos = end
        return view

    def flag(self, what: str) -> bool:
        b = self.take(1, what)[0]
        if b > 1:
            raise DecodeError(f"{what}: flag byte must be 0 or 1, got {b}")
        return b == 1

    def count(self, itemsize: int, what: str) -> int:
        n = _U32.unpack(self.take(4, what))[0]
        if n * itemsize > len(self.buf) - self.pos:
            raise DecodeError(f"{what}: count {n} needs {n * itemsize} bytes, {len(self.buf) - self.pos} remain")
        return n


def _dec_top(r: _Reader, what: str) -> list[list[tuple[int, float]]]:
    ntok = r.count(4, what)
    counts = np.frombuffer(r.take(4 * ntok, what), dtype=_U32_LE).astype(np.int64)
    total = int(counts.sum())
    if total * 12 > len(r.buf) - r.pos:
        raise DecodeError(f"{what}: {total} entries need {total * 12} bytes, {len(r.buf) - r.pos} remain")
    ids = np.frombuffer(r.take(4 * total, what), dtype=_I32_LE).tolist()
    lps = np.frombuffer(r.take(8 * total, what), dtype=_F64_LE).tolist()
    out, start = [], 0
    for c in counts.tolist():
        out.append(list(zip(ids[start : start + c], lps[start : start + c])))
        start += c
    return out


def _dec_str(r: _Reader, what: str) -> str:
    raw = r.take(r.count(1, what), what)
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as e:
        raise DecodeError(f"{what}: invalid UTF-8 ({e.reason} at byte {e.start})") from None


_DECODERS: dict[str, Callable[[_Reader, str], Any]] = {
    "i64": lambda r, w: _I64.unpack(r.take(8, w))[0],
    "f64": lambda r, w: _F64.unpack(r.take(8, w))[0],
    "bool": lambda r, w: r.flag(w),
    "str": _dec_str,
    "i32s": lambda r, w: np.frombuffer(r.take(4 * r.count(4, w), w), dtype=_I32_LE).tolist(),
    "f64s": lambda r, w: np.frombuffer(r.take(8 * r.count(8, w), w), dtype=_F64_LE).tolist(),
    "top": _dec_top,
    "params": lambda r, w: _decode_fields(SamplingParamsMsg, r),
}
for _kind in ("i64", "str", "f64s", "top"):
    _DECODERS["opt_" + _kind] = (lambda dec: lambda r, w: dec(r, w) if r.flag(w) else None)(_DECODERS[_kind])


def _decode_fields(cls: type, r: _Reader) -> Any:
    values = [_DECODERS[kind](r, f"{cls.__name__}.{name}") for name, kind in _SCHEMA[cls]]
    return cls(*values)


def decode(buf: bytes | bytearray | memoryview) -> Message:
    """Decode one message; raise DecodeError on anything but a well-formed encoding of one message."""
    view = memoryview(buf).cast("B")
    if len(view) == 0:
        raise DecodeError("empty buffer")
    cls = _BY_TAG.get(view[0])
    if cls is None:
        raise DecodeError(f"unknown message tag {view[0]}")
    r = _Reader(view[1:])
    msg = _decode_fields(cls, r)
    if r.pos != len(r.buf):
        raise DecodeError(f"{len(r.buf) - r.pos} trailing bytes after {cls.__name__}")
    return msg
