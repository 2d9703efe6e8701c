"""`kv_transfer_params`: the wire type of prefill/decode disaggregation's two-leg HTTP protocol.

A msgspec Struct (vLLM's field names where the meaning is the same), validated on decode; no
torch, no NIXL. Leg 1, proxy → prefill: `do_remote_decode`. The prefill answers with
`do_remote_prefill` and where its blocks are; leg 2 carries that object, through the proxy, to
the decode server. It rides inside `ipc.messages.Submit` / `Finished`, so it lives here, below
the engine: the engine's KV transfer (`engine/kv_transfer/protocol.py`) parses, signs and checks
it against its own layout.

Everything here may come from an HTTP client: the field types carry the limits, and
`__post_init__` the cross-field invariants (ValueError, which msgspec reports naming the field).
"""
from __future__ import annotations

import math
from typing import Annotated, Literal

from msgspec import Meta, Struct

GROUPS = ("full", "sliding")  # order of the per-group lists in KVTransferParams
DIGEST_ALG = "crc32c"
MAX_BLOCKS_PER_GROUP = 1 << 16  # 16 M tokens at block size 256
MAX_TOKENS = 1 << 24
MAX_TOP_LOGPROBS = 20

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$"  # engine ids, request ids, region names
EngineId = Annotated[str, Meta(min_length=1, max_length=128, pattern=NAME_PATTERN)]
TransferId = Annotated[str, Meta(min_length=1, max_length=128, pattern=NAME_PATTERN)]
Host = Annotated[str, Meta(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9.:\[\]-]+$")]
Port = Annotated[int, Meta(ge=1, le=65535)]
BlockId = Annotated[int, Meta(ge=1, le=2**31 - 1)]  # block 0 is every pool's dummy block
Digest = Annotated[int, Meta(ge=0, le=2**32 - 1)]
HexHash = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
BlockList = Annotated[list[BlockId], Meta(max_length=MAX_BLOCKS_PER_GROUP)]
DigestList = Annotated[list[Digest], Meta(max_length=MAX_BLOCKS_PER_GROUP)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]

# Set only on leg 2 (the prefill's answer); a leg-1 or plain request carrying one is refused.
_LEG2_REQUIRED = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_request_id",
                  "remote_blocks_expiry_time", "remote_num_tokens", "remote_sliding_first", "block_digests",
                  "compat_hash", "remote_first_token", "remote_prompt_hash")
_LEG2_OPTIONAL = ("remote_first_logprob", "remote_first_top_logprobs")


class KVTransferParams(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """`kv_transfer_params` of either leg. The remote_* fields stay None on leg 1 (vLLM's toy
    proxy sends them as null); on leg 2 they are all required."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: EngineId | None = None  # the prefill's transport agent name
    remote_block_ids: Annotated[list[BlockList], Meta(max_length=len(GROUPS))] | None = None  # per GROUPS
    remote_host: Host | None = None  # the prefill's KV side-channel listener
    remote_port: Port | None = None
    remote_request_id: TransferId | None = None  # the prefill's lease key
    remote_blocks_expiry_time: Annotated[float, Meta(ge=0.0)] | None = None  # unix seconds
    tp_size: Annotated[int, Meta(ge=1, le=1)] = 1  # ringserve ranks are TP 1
    # ringserve's own fields
    remote_num_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] | None = None  # prompt tokens held
    remote_sliding_first: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] | None = None  # logical block of sliding[0]
    block_digests: Annotated[list[DigestList], Meta(max_length=len(GROUPS))] | None = None
    # The token the prefill sampled from the prompt's last position (the decode emits it as the
    # first output token, once the KV it belongs to is verified), and its logprobs if asked for.
    remote_first_token: TokenId | None = None
    remote_first_logprob: float | None = None
    remote_first_top_logprobs: Annotated[list[tuple[TokenId, float]], Meta(max_length=MAX_TOP_LOGPROBS)] | None = None
    remote_prompt_hash: HexHash | None = None  # prompt_hash() of the token ids the prefill computed
    digest_alg: Literal["crc32c"] = DIGEST_ALG
    compat_hash: HexHash | None = None
    params_mac: HexHash | None = None

    def __post_init__(self) -> None:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("do_remote_decode and do_remote_prefill are exclusive")
        if not self.do_remote_prefill:
            given = [f for f in _LEG2_REQUIRED + _LEG2_OPTIONAL if getattr(self, f) is not None]
            if given:  # leg 1 / plain requests: a client never supplies where blocks are
                raise ValueError(f"{given[0]} is only valid with do_remote_prefill")
            return
        missing = [f for f in _LEG2_REQUIRED if getattr(self, f) is None]
        if missing:
            raise ValueError(f"do_remote_prefill needs {missing[0]}")
        if len(self.remote_block_ids) != len(GROUPS) or len(self.block_digests) != len(GROUPS):
            raise ValueError(f"remote_block_ids and block_digests need one list per group {GROUPS}")
        for group, ids, digests in zip(GROUPS, self.remote_block_ids, self.block_digests):
            if len(ids) != len(digests):
                raise ValueError(f"group {group}: {len(ids)} block ids but {len(digests)} digests")
            if len(set(ids)) != len(ids):
                raise ValueError(f"group {group}: duplicate block ids")
        if not math.isfinite(self.remote_blocks_expiry_time):
            raise ValueError("remote_blocks_expiry_time must be finite")

    def group_blocks(self, group: str) -> tuple[list[int], list[int]]:
        """(remote block ids, digests) of one group."""
        i = GROUPS.index(group)
        return self.remote_block_ids[i], self.block_digests[i]
