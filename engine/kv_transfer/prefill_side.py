"""The prefill side of the connector: compute a prompt, hold its blocks under a lease, hand out
`kv_transfer_params`, free the blocks when the decode is done with them (or never comes).

A request with `do_remote_decode` runs as an ordinary request capped at one output token. In
the step that samples that token (before the scheduler frees the request's blocks) `hold`
takes a reference on the blocks the transfer plan names, digests exactly the planned bytes and
opens a lease; the scheduler's own free then leaves them allocated. `attach` puts the params
on the request's `Finished`. The blocks go back when a `KVDone` arrives (the decode's READ
completed, or it gave up), or when the lease runs out unrenewed (`tick`).
"""
from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

from msgspec.structs import replace

from ipc.kv_transfer_params import GROUPS, KVTransferParams
from ipc.messages import Finished, SamplingParams

from . import protocol as wire
from .context import ConnectorContext, group_digests, log, wall_expiry
from .kv_pools import plan_block_ids
from .lease import LeaseTable

if TYPE_CHECKING:
    from engine.batch import Batch, RequestStepOutput, StepOutput
    from engine.request import Request

_PRUNE_EVERY_S = 5.0


class PrefillSide:
    def __init__(self, ctx: ConnectorContext):
        self.ctx = ctx
        self.leases = LeaseTable(max_hold_s=ctx.config.max_hold_s)
        self.remote_decode: set[int] = set()  # request ids to hold when they finish
        self._held: dict[int, KVTransferParams] = {}  # held this step, not yet attached
        self._next_prune = time.monotonic() + _PRUNE_EVERY_S

    @staticmethod
    def capped(params: SamplingParams) -> SamplingParams:
        """A remote-decode request samples exactly one token here (the decode produces the rest)."""
        return replace(params, max_tokens=1)

    # ---- hand-off -----------------------------------------------------------------------------
    def before_update(self, batch: "Batch", step: "StepOutput") -> None:
        """Hold the blocks of every remote-decode request that sampled its token in this step."""
        for s in batch.scheduled:
            req = s.request
            if req.request_id not in self.remote_decode or not s.reaches_end or req.is_finished:
                continue
            out = step.outputs.get(req.request_id)
            if out is not None and out.error is None and out.accepted:
                self._held[req.request_id] = self._hold(req, out)

    def _hold(self, req: "Request", out: "RequestStepOutput") -> KVTransferParams:
        ctx, n = self.ctx, req.num_prompt_tokens
        plan = ctx.plan(n)
        ids = plan_block_ids(req.seq.table, plan.blocks)
        digests = group_digests(ctx.cache, plan, ids)  # before anyone could write them again
        ctx.cache.manager.full.incref(ids["full"])
        ctx.cache.manager.sliding.incref(ids["sliding"])
        lease_id = f"r{req.request_id}-{secrets.token_hex(6)}"
        self.leases.hold(lease_id, (ids["full"], ids["sliding"]), ctx.config.lease_s)
        ctx.counters.held += 1
        top = out.top_logprobs[0] if out.top_logprobs else None
        params = KVTransferParams(
            do_remote_prefill=True, remote_engine_id=ctx.name, remote_block_ids=[ids[g] for g in GROUPS],
            remote_host=ctx.host, remote_port=ctx.port, remote_request_id=lease_id,
            remote_blocks_expiry_time=wall_expiry(self.leases.remaining(lease_id)), remote_num_tokens=n,
            remote_sliding_first=plan.blocks["sliding"][0], block_digests=[digests[g] for g in GROUPS],
            compat_hash=ctx.compat, remote_first_token=out.accepted[0],
            remote_first_logprob=out.logprobs[0] if out.logprobs else None,
            remote_first_top_logprobs=[(int(t), float(v)) for t, v in top] if top is not None else None,
            remote_prompt_hash=wire.prompt_hash(req.prompt_token_ids))
        return wire.sign(params, ctx.key) if ctx.key else params

    def attach(self, finished: list[Finished]) -> list[Finished]:
        """Put the params on the Finished of each request held this step; release a hold whose
        request did not end normally (it cannot be decoded from)."""
        if not self.remote_decode:
            return finished
        out = []
        for f in finished:
            self.remote_decode.discard(f.request_id)
            params = self._held.pop(f.request_id, None)
            if params is not None:
                if f.reason in ("length", "stop"):
                    f = replace(f, kv_transfer_params=params)
                else:
                    self.release(params.remote_request_id, f"its request ended with {f.reason}")
            out.append(f)
        for rid, params in self._held.items():  # held but not finished: cannot happen with max_tokens 1
            log.error("request %d was held for a decode but did not finish; releasing its blocks", rid)
            self.release(params.remote_request_id, "not finished")
        self._held.clear()
        return out

    def forget(self, request_id: int) -> None:
        self.remote_decode.discard(request_id)

    # ---- leases -------------------------------------------------------------------------------
    def release(self, lease_id: str, why: str) -> bool:
        blocks = self.leases.release(lease_id)
        if blocks is None:
            return False
        self.ctx.free_blocks(*blocks)
        self.ctx.counters.released += 1
        log.debug("lease %s released: %s", lease_id, why)
        return True

    def on_notification(self, peer: str, msg: wire.KVRenew | wire.KVDone) -> None:
        if isinstance(msg, wire.KVRenew):
            for lease_id in msg.request_ids:
                self.leases.renew(lease_id)
        else:
            for lease_id in msg.request_ids:
                self.release(lease_id, "read by " + peer if msg.ok else f"{peer} gave up: {msg.reason}")

    def tick(self) -> None:
        """Free the blocks of leases nobody renewed; forget readers long silent."""
        for lease_id, blocks in self.leases.expired():
            self.ctx.free_blocks(*blocks)
            self.ctx.counters.expired += 1
            log.warning("lease %s expired unread; its blocks are free again", lease_id)
        now = time.monotonic()
        if now >= self._next_prune:
            self._next_prune = now + _PRUNE_EVERY_S
            for peer in self.ctx.transport.prune(self.ctx.config.idle_peer_s):
                log.info("forgot KV reader %s (silent for %.0f s)", peer, self.ctx.config.idle_peer_s)

    @property
    def busy(self) -> bool:
        return bool(self.leases)

    def held_blocks(self) -> int:
        return sum(len(full) + len(sliding) for _, (full, sliding) in self.leases.held())

    def close(self) -> None:
        for lease_id, _ in self.leases.held():
            self.release(lease_id, "shutting down")
