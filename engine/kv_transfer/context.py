"""What both sides of the KV connector share: the transport, the pools, the compatibility hash,
the counters; and the plan → spans → digests arithmetic both sides must do identically."""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import digest
from .config import KVTransferConfig
from .plan import TransferPlan, make_plan

if TYPE_CHECKING:
    from engine.kv_cache import KVCache

    from .transport import KVTransport

log = logging.getLogger("engine.kv_connector")


@dataclass
class Counters:
    """Cumulative since start (the heartbeat carries them to the server)."""

    held: int = 0  # prefill: requests whose blocks were put under a lease
    released: int = 0  # prefill: leases ended by the decode (read, or gave up)
    expired: int = 0  # prefill: leases that ran out unread
    loaded: int = 0  # decode: requests whose KV arrived and verified
    failed: int = 0  # decode: loads that failed (transfer, digest, timeout)
    digest_failures: int = 0
    recomputed: int = 0  # decode: failed loads recomputed locally (--kv-load-failure-policy recompute)
    bytes_read: int = 0
    read_s: float = 0.0  # decode: summed READ time (posting → done)
    last_connect_s: float = 0.0
    last_read_s: float = 0.0
    last_verify_s: float = 0.0
    last_bytes: int = 0


@dataclass
class ConnectorContext:
    cache: "KVCache"
    config: KVTransferConfig
    transport: "KVTransport"
    host: str
    port: int  # this engine's KV side channel (advertised to decodes)
    key: bytes | None = None
    counters: Counters = field(default_factory=Counters)
    # Resolved replay (plan.replay_policy): 0 = V4's sliding rows cross; else positions the
    # decode recomputes, its resume point rounded down to a multiple of `replay_align`.
    replay_tokens: int = 0
    replay_align: int = 1

    def __post_init__(self) -> None:
        if self.port:  # a prefill: its side channel listens where decodes are told to reach it
            self.transport.listen_at(self.host)

    @property
    def name(self) -> str:
        return self.transport.name

    @property
    def compat(self) -> str:
        return self.transport.layout_digest()

    def plan(self, num_tokens: int) -> TransferPlan:
        """The transfer plan of a prompt of `num_tokens` tokens (both sides derive the same)."""
        return make_plan(self.cache.layout, num_tokens, self.replay_tokens, self.replay_align)

    def free_blocks(self, full: list[int], sliding: list[int]) -> None:
        self.cache.manager.full.free(full)
        self.cache.manager.sliding.free(sliding)


def shared_key() -> bytes | None:
    """The HMAC key over kv_transfer_params, derived from the cluster key (ipc/cluster_auth.py;
    a worker finds it through the environment its server exported), or None without one."""
    from ipc import cluster_auth

    return cluster_auth.current().mac_key(cluster_auth.KV_PARAMS_MAC)


def free_port() -> int:
    """A TCP port free on every interface now (so also on the side channel's address)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def spans(plan: TransferPlan, ids: dict[str, list[int]]) -> dict[str, list[tuple[int, int, int, int]]]:
    """{pool: [(position in its group's block list, block id, byte offset, bytes)]} for a table's
    block ids of the plan (`ids[group][i]` is logical block plan.blocks[group][0] + i)."""
    out = {}
    for r in plan.ranges:
        first = plan.blocks[r.group][0]
        group_ids = ids[r.group]
        out[r.pool] = [(blk - first, group_ids[blk - first], off, nb) for blk, off, nb in r.spans()]
    return out


def group_digests(cache: "KVCache", plan: TransferPlan, ids: dict[str, list[int]]) -> dict[str, list[int]]:
    """{group: one CRC32C per block of its block list} over exactly the planned bytes."""
    by_pool = spans(plan, ids)
    out = {}
    for group, (first, end) in plan.blocks.items():
        pieces = [([cache.pools[r.pool].tensors[layer] for layer in cache.pools[r.pool].spec.layers], by_pool[r.pool])
                  for r in plan.ranges if r.group == group]
        out[group] = digest.span_digests(pieces, end - first)
    return out


def wall_expiry(remaining_s: float) -> float:
    """A lease's expiry as unix seconds (what kv_transfer_params carries)."""
    return time.time() + remaining_s
