"""The KV connector: one engine's part in prefill/decode disaggregation (vLLM's KVConnector).

It owns the engine's KV transport (the one `--kv-transfer` names, kv_transfer/registry.py; every
KV pool registered, host or device memory) and
answers the questions vLLM's connector answers for its scheduler, at the engine's seams:

  * "how many tokens of this request are available remotely, and load them into its blocks"
    → `add_request` of a `do_remote_prefill` request: all of its prompt. The request waits
    here (engine/kv_transfer/decode_side.py) while its blocks are allocated and READ, and
    reaches the scheduler with its prompt computed and the prefill's first token.
  * "request finished: hold its blocks under a lease, and say where they are"
    → `before_update` / `attach` for a `do_remote_decode` request
    (engine/kv_transfer/prefill_side.py), which puts `kv_transfer_params` on its `Finished`.

The engine calls `tick()` once per step (and the worker while idle, every `poll_interval()`):
notifications (lease renewals and releases, handshakes), READ completions, lease expiry.
Everything runs on the engine loop's thread; the heartbeat thread reads only `last_stats`.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ipc.kv_transfer_params import KVTransferParams
from ipc.messages import Finished, KVTransferStats, SamplingParams, StepOutputs

from .kv_transfer import protocol as wire
from .kv_transfer.config import KVTransferConfig
from .kv_transfer.context import ConnectorContext, free_port, log, shared_key
from .kv_transfer.decode_side import DecodeSide
from .kv_transfer.kv_pools import compat_identity, pool_regions
from .kv_transfer.plan import replay_policy
from .kv_transfer.prefill_side import PrefillSide
from .kv_transfer.regions import unique_name
from .kv_transfer.registry import open_transport
from .request import Request, RequestError

if TYPE_CHECKING:
    from .batch import Batch, StepOutput
    from .engine import Engine

_STATS_EVERY_S = 0.1
_COMPUTE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


class KVConnector:
    def __init__(self, engine: "Engine", config: KVTransferConfig, rank: int = 0):
        cache = engine.cache
        replay, align = replay_policy(cache.layout, getattr(engine.model.cfg, "arch", "v4"), config.replay_tokens,
                                      _receptive_field(engine))
        identity = compat_identity(engine.model.cfg, cache.layout, model_id=config.model_id,
                                   compute_dtype=_COMPUTE[str(engine.model.dtype)],
                                   extra={"slack": cache.manager.slack, "replay_tokens": replay,
                                          "replay_align": align, "plan": "spans/1"})
        # A prefill is reached on a known port (rank r: port + r); a decode only fetches.
        port = (config.port + rank if config.port else free_port()) if config.prefills else None
        transport = open_transport(config.transport, unique_name(f"ringserve-{config.role}-r{rank}"), port,
                                   identity=identity)
        try:
            transport.register(pool_regions(cache))
        except BaseException:
            transport.close()
            raise
        self.ctx = ConnectorContext(cache, config, transport, config.host, port or 0, shared_key(),
                                    replay_tokens=replay, replay_align=align)
        self.config, self.rank, self.scheduler = config, rank, engine.scheduler
        self.prefill = PrefillSide(self.ctx) if config.prefills else None
        self.decode = DecodeSide(self.ctx, engine.scheduler, engine.model.cfg.vocab_size) if config.decodes else None
        self.last_stats = self._stats()
        self._stats_at = time.monotonic()
        log.info("KV connector %s: role %s, %s transport, side channel %s:%s", transport.name, config.role,
                 config.transport, config.host, port)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: int, prompt: list[int], params: SamplingParams,
                    kv: KVTransferParams, multimodal=None) -> Request:
        """Admit a request that carries kv_transfer_params (RequestError → refused with 400).
        `multimodal`: its images (engine/v41/vision/inputs.py), checked by the engine."""
        if kv.do_remote_prefill:
            if self.decode is None:
                raise RequestError("this server's --kv-role is prefill: it does not decode from a remote prefill")
            return self.decode.add(request_id, prompt, params, kv, multimodal)
        req = Request(request_id, list(prompt), params)
        if kv.do_remote_decode:
            if self.prefill is None:
                raise RequestError("this server's --kv-role is decode: it does not prefill for a remote decode")
            req = Request(request_id, list(prompt), self.prefill.capped(params))
        req.multimodal = multimodal  # the prefill leg runs the encoder
        self.scheduler.add(req)
        if kv.do_remote_decode:
            self.prefill.remote_decode.add(request_id)
        return req

    def abort(self, request_id: int) -> Finished | None:
        """A request waiting for remote KV ends here; any other is the scheduler's (forgotten here)."""
        if self.prefill is not None:
            self.prefill.forget(request_id)
        return self.decode.abort(request_id) if self.decode is not None else None

    # ---- the step -----------------------------------------------------------------------------
    def before_update(self, batch: "Batch", step: "StepOutput") -> None:
        if self.prefill is not None and self.prefill.remote_decode:
            self.prefill.before_update(batch, step)

    def attach(self, finished: list[Finished]) -> list[Finished]:
        return self.prefill.attach(finished) if self.prefill is not None and finished else finished

    def tick(self) -> StepOutputs | None:
        """Notifications, lease expiry, loads; the deltas and finishes of loads that ended."""
        for peer, data in self.ctx.transport.notifications():  # also answers handshakes
            try:
                msg = wire.decode_notification(data)
            except wire.ProtocolError as exc:
                log.warning("dropping a notification from %s: %s", peer, exc)
                continue
            if self.prefill is not None:
                self.prefill.on_notification(peer, msg)
        if self.prefill is not None:
            self.prefill.tick()
        out = None
        if self.decode is not None and self.decode.busy:
            deltas, finished = self.decode.tick()
            if deltas or finished:
                out = StepOutputs(deltas, finished)
        now = time.monotonic()
        if now - self._stats_at >= _STATS_EVERY_S:
            self.last_stats, self._stats_at = self._stats(), now
        return out

    def poll_interval(self) -> float:
        """How soon the idle worker should tick again: fast while a transfer is under way."""
        if self.decode is not None and self.decode.busy:
            return 0.001
        if self.prefill is not None and self.prefill.busy:
            return 0.002
        return 0.02

    # ---- state --------------------------------------------------------------------------------
    def _stats(self) -> KVTransferStats:
        t = self.ctx.transport.state()
        c = self.ctx.counters
        held = (self.prefill.held_blocks() if self.prefill else 0) + (self.decode.held_blocks() if self.decode else 0)
        return KVTransferStats(
            self.config.role, self.ctx.name, self.ctx.port, len(self.prefill.leases) if self.prefill else 0, held,
            len(self.decode.loads) if self.decode else 0, t["peers"], t["served"], len(t["connecting"]),
            t["pending_transfers"], c.held, c.released, c.expired, c.loaded, c.failed, c.digest_failures,
            c.recomputed, c.bytes_read, c.read_s, c.last_connect_s, c.last_read_s, c.last_verify_s, c.last_bytes)

    def close(self) -> None:
        """Free every held block, cancel loads, close the transport (deregisters the pools)."""
        if self.ctx.transport.closed:
            return
        if self.decode is not None:
            self.decode.close()
        if self.prefill is not None:
            self.prefill.close()
        self.ctx.transport.close()
        self.last_stats = self._stats()


def _receptive_field(engine: "Engine") -> int:
    """Positions an exact replay recomputes (engine/prefix_cache.py owns the formula; prefix
    caching itself is off under PD roles)."""
    from .prefix_cache import receptive_field

    return receptive_field(engine.cache)


def attach_connector(engine: "Engine", rank: int = 0) -> KVConnector | None:
    """Give the engine the connector its config asks for (None without --kv-transfer)."""
    config = engine.config.kv_transfer
    if config is None:
        return None
    engine.connector = KVConnector(engine, config, rank)
    return engine.connector
