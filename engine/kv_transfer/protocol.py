"""Wire types of PD transfer, as msgspec Structs validated on decode (nothing that decodes to code, no torch).

Two vocabularies:
  * `KVTransferParams` (the `kv_transfer_params` JSON object of the two-leg HTTP protocol; its
    type is a wire type, `ipc/kv_transfer_params.py`): parsed, signed and checked against this
    engine's layout here.
  * notifications between the two engines over NIXL: `KVRenew` (decode heartbeats while it waits
    to READ) and `KVDone` (decode read the blocks, or gave up: the prefill frees them); and the
    transport's own handshake (`Hello`, `HelloReply`, `Bye`), framed with a magic prefix that
    can never start a msgpack message, so the transport tells them apart without decoding.

Everything here arrives from another machine or from an HTTP client: decoding checks every
field's type and limit and the cross-field invariants (`__post_init__`), and refuses anything
else with `ProtocolError` naming the field. Nothing decoded here sizes an allocation by itself:
`check_for_decode` compares the sizes a prefill claims with the ones the decode server derives
from its own prompt and layout (reliability.md: "transfer metadata never comes from clients").
`sign` / `verify` add an optional HMAC over the params with a key the two engines share, so a
client that talks to the decode server directly cannot forge block ids or digests.
"""
from __future__ import annotations

import array
import hashlib
import hmac
import sys
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct

from ipc.kv_transfer_params import NAME_PATTERN, HexHash, KVTransferParams, TransferId

MAX_IDS_PER_NOTIFICATION = 1024
MAX_REGIONS = 256
MAX_TENSORS_PER_REGION = 1024
MAX_DESCRIPTORS = 1 << 26  # bounds what a peer's geometry can make us prepare
MAX_NOTIFICATION_BYTES = 1 << 20
HANDSHAKE_MAGIC = b"\xc1RSKV"  # 0xc1 is never used by msgpack: app notifications cannot collide
HANDSHAKE_VERSION = 1

Nonce = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Reason = Annotated[str, Meta(max_length=512)]
IdList = Annotated[list[TransferId], Meta(min_length=1, max_length=MAX_IDS_PER_NOTIFICATION)]


class ProtocolError(ValueError):
    """Transfer metadata or a notification that does not decode or does not add up."""


# ---- kv_transfer_params ---------------------------------------------------------------------
def parse_params(obj: Any) -> KVTransferParams:
    """The request body's `kv_transfer_params` (already JSON-decoded), validated; ProtocolError
    naming the field otherwise."""
    try:
        return msgspec.convert(obj, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"kv_transfer_params: {exc}") from None


def params_to_json(params: KVTransferParams) -> dict[str, Any]:
    """Plain JSON-able dict for an HTTP response (defaults omitted)."""
    return msgspec.to_builtins(params)


def _mac(params: KVTransferParams, key: bytes) -> str:
    body = msgspec.msgpack.encode(msgspec.structs.replace(params, params_mac=None))
    return hmac.new(key, b"ringserve-kv-params/1" + body, hashlib.sha256).hexdigest()


def sign(params: KVTransferParams, key: bytes) -> KVTransferParams:
    """The params with `params_mac` set: HMAC-SHA256 under the key both engines share."""
    return msgspec.structs.replace(params, params_mac=_mac(params, key))


def verify(params: KVTransferParams, key: bytes) -> None:
    """ProtocolError unless `params_mac` is the MAC of these params under `key`."""
    if params.params_mac is None:
        raise ProtocolError("kv_transfer_params: params_mac is required")
    if not hmac.compare_digest(params.params_mac, _mac(params, key)):
        raise ProtocolError("kv_transfer_params: params_mac does not match (forged or altered)")


def expected_blocks(num_tokens: int, block_size: int, sliding_keep: int) -> dict[str, tuple[int, int]]:
    """Logical blocks [first, end) whose ids cross per group after `num_tokens` prompt tokens:
    every full-group block, and the sliding blocks that overlap the trailing `sliding_keep`
    positions (the widest sliding window: what the decode may still read)."""
    end = -(-num_tokens // block_size)
    return {"full": (0, end), "sliding": (max(0, num_tokens - sliding_keep) // block_size, end)}


def prompt_hash(token_ids: list[int]) -> str:
    """SHA-256 (hex) of a prompt's token ids: the decode checks it computes what the prefill did."""
    body = array.array("I", token_ids)  # uint32 each, little-endian on the wire
    if sys.byteorder == "big":
        body.byteswap()
    return hashlib.sha256(b"ringserve-prompt/1\0" + body.tobytes()).hexdigest()


def check_for_decode(params: KVTransferParams, *, prompt_token_ids: list[int], blocks: dict[str, tuple[int, int]],
                     compat_hash: str, now: float) -> None:
    """The gate before a decode server allocates anything for a remote prefill. Sizes come from
    the decode's own prompt and layout (`blocks`: the transfer plan's logical block range per
    group); the params must agree with them exactly. ProtocolError otherwise."""
    if not params.do_remote_prefill:
        raise ProtocolError("kv_transfer_params: not a remote prefill (do_remote_prefill is false)")
    if params.compat_hash != compat_hash:
        raise ProtocolError("kv_transfer_params: compat_hash differs from this engine's (other model or layout)")
    n = len(prompt_token_ids)
    if params.remote_num_tokens != n:
        raise ProtocolError(f"kv_transfer_params: remote_num_tokens {params.remote_num_tokens} != prompt length {n}")
    if params.remote_prompt_hash != prompt_hash(prompt_token_ids):
        raise ProtocolError("kv_transfer_params: remote_prompt_hash differs: the prefill computed another prompt")
    if params.remote_blocks_expiry_time <= now:
        raise ProtocolError("kv_transfer_params: the prefill's blocks already expired")
    for group, (first, end) in blocks.items():
        ids, _ = params.group_blocks(group)
        if len(ids) != end - first:
            raise ProtocolError(f"kv_transfer_params: group {group} has {len(ids)} blocks, "
                                f"{end - first} expected for {n} tokens")
    if params.remote_sliding_first != blocks["sliding"][0]:
        raise ProtocolError(f"kv_transfer_params: remote_sliding_first {params.remote_sliding_first} != "
                            f"{blocks['sliding'][0]}")


# ---- notifications (engine ↔ engine over NIXL) ----------------------------------------------
class KVRenew(Struct, frozen=True, array_like=True, tag=1):
    """Decode → prefill heartbeat: still queued, keep these leases."""

    request_ids: IdList


class KVDone(Struct, frozen=True, array_like=True, tag=2):
    """Decode → prefill: finished with these blocks (read and verified, or gave up); free them."""

    request_ids: IdList
    ok: bool = True
    reason: Reason = ""


Notification = Union[KVRenew, KVDone]
_NOTIFY_ENCODER = msgspec.msgpack.Encoder()
_NOTIFY_DECODER = msgspec.msgpack.Decoder(Notification)


def encode_notification(msg: KVRenew | KVDone) -> bytes:
    return _NOTIFY_ENCODER.encode(msg)


def decode_notification(data: bytes) -> KVRenew | KVDone:
    try:
        return _NOTIFY_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"notification: {exc}") from None


# ---- transport handshake --------------------------------------------------------------------
class Hello(Struct, frozen=True, array_like=True, tag=1):
    """Reader → server after it loaded the server's NIXL metadata (and sent its own)."""

    version: Annotated[int, Meta(ge=1, le=2**16)]
    compat_hash: HexHash
    nonce: Nonce


class RegionGeometry(Struct, frozen=True, array_like=True):
    """Where one region's blocks are in the server's memory: tensor t, block b is
    base_addrs[t] + b · block_bytes."""

    name: Annotated[str, Meta(min_length=1, max_length=128, pattern=NAME_PATTERN)]
    mem_type: Literal["DRAM", "VRAM"]
    device_id: Annotated[int, Meta(ge=0, le=1024)]
    block_bytes: Annotated[int, Meta(ge=1, le=2**31)]
    num_blocks: Annotated[int, Meta(ge=1, le=2**31)]
    base_addrs: Annotated[list[Annotated[int, Meta(ge=1)]], Meta(min_length=1,
                                                                              max_length=MAX_TENSORS_PER_REGION)]


class HelloReply(Struct, frozen=True, array_like=True, tag=2):
    """Server → reader: accepted (with the geometry to READ from) or refused (with why)."""

    nonce: Nonce
    ok: bool
    compat_hash: HexHash
    reason: Reason = ""
    regions: Annotated[list[RegionGeometry], Meta(max_length=MAX_REGIONS)] = []

    def __post_init__(self) -> None:
        total = sum(r.num_blocks * len(r.base_addrs) for r in self.regions)
        if total > MAX_DESCRIPTORS:
            raise ValueError(f"geometry of {total} descriptors exceeds {MAX_DESCRIPTORS}")
        if len({r.name for r in self.regions}) != len(self.regions):
            raise ValueError("duplicate region names")


class Bye(Struct, frozen=True, array_like=True, tag=3):
    """Either side closes: drop my metadata and forget me."""


Handshake = Union[Hello, HelloReply, Bye]
_HS_DECODER = msgspec.msgpack.Decoder(Handshake)


def is_handshake(data: bytes) -> bool:
    return data[: len(HANDSHAKE_MAGIC)] == HANDSHAKE_MAGIC


def encode_handshake(msg: Hello | HelloReply | Bye) -> bytes:
    return HANDSHAKE_MAGIC + _NOTIFY_ENCODER.encode(msg)


def decode_handshake(data: bytes) -> Hello | HelloReply | Bye:
    if not is_handshake(data):
        raise ProtocolError("not a handshake message")
    try:
        return _HS_DECODER.decode(data[len(HANDSHAKE_MAGIC):])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"handshake: {exc}") from None
