"""How one engine takes part in prefill/decode disaggregation (`--kv-role`, `--kv-transfer`, …).

`KVTransferConfig` travels inside `EngineConfig` as JSON to every worker process, so it is a
msgspec Struct of plain values, validated on decode. No torch, no transport library: the HTTP
process builds it from the command line. `transport` names a registry.py entry.

Roles (vLLM's names): `prefill` computes prompts and holds their KV blocks under a lease for a
decode server to READ; `decode` READs a prefill's blocks and generates from them; `both` is a
colocated server that also serves as either (a request's `kv_transfer_params` decide).
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from .registry import transport_names

ROLES = ("prefill", "decode", "both")
FAILURE_POLICIES = ("fail", "recompute")

Seconds = Annotated[float, Meta(gt=0.0, le=86400.0)]


class KVTransferConfig(Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["prefill", "decode", "both"] = "both"
    transport: Annotated[str, Meta(min_length=1, max_length=64)] = "nixl"  # a registry.py name
    # Advertised in kv_transfer_params: where a decode reaches this engine's KV side channel.
    host: Annotated[str, Meta(min_length=1, max_length=255)] = "127.0.0.1"
    # Side-channel port of rank 0; rank r listens on port + r. 0 = a free port per rank.
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    failure_policy: Literal["fail", "recompute"] = "fail"
    lease_s: Seconds = 30.0  # a prefill holds unread blocks this long without a renewal
    max_hold_s: Seconds = 480.0  # renewals never hold blocks longer than this
    connect_timeout_s: Seconds = 10.0  # decode: transport metadata + compatibility handshake
    transfer_timeout_s: Seconds = 30.0  # decode: one READ, from posting to done
    # The weights' identity (name + fingerprint), part of the compatibility hash: two engines
    # exchange KV only if they run the same weights with the same layout.
    model_id: Annotated[str, Meta(max_length=512)] = ""
    # Forget a peer that has been silent this long (prefill: a reader; decode: an idle server).
    idle_peer_s: Seconds = 120.0
    # Replay transfer: only the global (full-group) rows cross and the decode recomputes its
    # last `replay_tokens` prompt positions. 0 = the model's default: V4 moves window and
    # compressor rows too; V4.1 replays the receptive field, exactly (plan.replay_policy).
    replay_tokens: Annotated[int, Meta(ge=0, le=1 << 20)] = 0

    def __post_init__(self) -> None:
        if self.transport not in transport_names():
            raise ValueError(f"unknown KV transport {self.transport!r}; one of {', '.join(transport_names())}")

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)
