"""The wire format of `ipc.messages`: msgpack through msgspec, validated on decode.

Each message is a msgpack array whose first element is the type's integer tag, then its fields
in declaration order (msgspec `array_like` + `tag`). Decoding checks the tag, the structure and
every field's type and limits (the `Annotated` constraints in `ipc.messages`), and that nothing
trails; any failure is a `DecodeError`, never a crash and never a partly built message.
Encoding checks nothing it does not have to (the edge validated the values with `check`); a value
msgpack cannot hold at all (an int beyond 64 bits, a string with lone surrogates) is an
`EncodeError`. `decode` copies what it keeps, so it is safe on a ring slot's memoryview.
"""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from ipc.errors import DecodeError, EncodeError, MessageTooLarge
from ipc.messages import MESSAGE_TYPES, FromWorker, Message, ToWorker

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {
    "any": msgspec.msgpack.Decoder(Message),
    "to_worker": msgspec.msgpack.Decoder(ToWorker),
    "from_worker": msgspec.msgpack.Decoder(FromWorker),
}
_MESSAGE_TYPES = frozenset(MESSAGE_TYPES)


def encode(msg: Message, max_bytes: int | None = None) -> bytes:
    """Encode one message; EncodeError if msgpack cannot hold a value, MessageTooLarge past
    `max_bytes` (the message names both sizes)."""
    if type(msg) not in _MESSAGE_TYPES:
        raise EncodeError(f"not an ipc message: {type(msg).__name__}")
    try:
        data = _ENCODER.encode(msg)
    except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as exc:
        raise EncodeError(f"cannot encode {type(msg).__name__}: {exc}") from None
    if max_bytes is not None and len(data) > max_bytes:
        raise MessageTooLarge(f"encoded {type(msg).__name__} is {len(data)} bytes, limit is {max_bytes} bytes")
    return data


def decode(buf: bytes | bytearray | memoryview, direction: str = "any") -> Message:
    """Decode one message. `direction` ('to_worker', 'from_worker' or 'any') restricts which
    types are accepted; anything else is a DecodeError naming what was wrong and where."""
    try:
        return _DECODERS[direction].decode(buf)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"malformed message: {exc}") from None
    except (ValueError, TypeError) as exc:  # raised by a Struct's own checks
        raise DecodeError(f"invalid message: {exc}") from None


class InvalidField(ValueError):
    """A value the wire type refuses; `field` names it (dotted, e.g. 'seed' or 'params.top_k')."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field, self.reason = field, message


def check(value: T) -> T:
    """Return `value` if its type's wire decoder accepts it (every limit in its annotations),
    else raise InvalidField naming the first offending field. This is the one validation of
    anything that enters at an edge (HTTP, CLI, offline API) before it reaches a worker."""
    cls = type(value)
    try:
        return msgspec.msgpack.decode(_ENCODER.encode(value), type=cls)
    except msgspec.ValidationError as exc:
        field, message = _locate(cls, str(exc))
        raise InvalidField(field, message) from None
    except (OverflowError, UnicodeEncodeError, TypeError) as exc:
        raise InvalidField(_unencodable(value), f"cannot be represented: {exc}") from None


def _unencodable(value: Any, prefix: str = "") -> str:
    """The dotted name of the first field of a Struct that msgpack cannot hold ('' if none)."""
    for name in getattr(value, "__struct_fields__", ()):
        field = getattr(value, name)
        try:
            _ENCODER.encode(field)
        except (OverflowError, UnicodeEncodeError, TypeError):
            inner = _unencodable(field, f"{prefix}{name}.")
            return inner or f"{prefix}{name}"
    return ""


def _locate(cls: type, text: str) -> tuple[str, str]:
    """msgspec says 'Expected `int` >= 0 - at `$[3][0]`'; turn the array path into field names."""
    message, _, path = text.partition(" - at `")
    indices = [int(p) for p in path.rstrip("`").lstrip("$").strip("[]").split("][") if p.isdigit()]
    names: list[str] = []
    current: Any = cls
    for i in indices:
        fields = getattr(current, "__struct_fields__", None)
        if not fields:
            break  # inside a list or tuple: the field already named is the one
        offset = 1 if getattr(current, "__struct_config__", None) and current.__struct_config__.tag else 0
        if i - offset >= len(fields) or i < offset:
            break
        name = fields[i - offset]
        names.append(name)
        current = _field_type(current, name)
    return ".".join(names), message


def _field_type(cls: type, name: str) -> Any:
    hints = msgspec.structs.fields(cls)
    for f in hints:
        if f.name == name:
            return f.type if isinstance(f.type, type) else None
    return None
