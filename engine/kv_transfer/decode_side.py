"""The decode side of the connector: take a request whose prompt a prefill server computed, pull
its KV, verify it, and only then let it generate.

A request with `do_remote_prefill` never enters the scheduler while its KV is remote. It waits
here as a `_Load`, in arrival order, through:
  1. blocks  — allocate its blocks (the same logical blocks the plan names; FIFO, no preemption);
  2. connect — one transport handshake per prefill engine (compatibility hash checked), shared;
  3. read    — one READ of exactly the planned byte spans, by block index;
  4. verify  — once the transport reports the READ done, re-digest every block and compare.
Meanwhile it renews the prefill's lease every third of its lifetime. Verified, the request
gets its blocks, `num_computed_tokens` = the prompt (or the replay point), the prefill's first
token appended and emitted, and joins the scheduler's queue; its next step is an ordinary
decode step, or (a replay plan: V4.1, `--kv-replay-tokens`) the recomputation of its last prompt
positions on the global records that arrived (`_prepare_replay`). Any failure frees its blocks
and either fails the request with the reason (`fail`) or queues it for a local prefill
(`recompute`); a corrupt block is never decoded from.

Blocks a READ may still write are never freed: an abandoned load whose READ is in flight is
parked until the transport reports it done or failed (a timed-out READ disconnects the peer first).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipc.kv_transfer_params import GROUPS, KVTransferParams
from ipc.messages import Finished, SamplingParams, TokenDelta
from ipc.prompt_checks import TokenOutsideVocabulary, check_token_ids

from . import protocol as wire
from .context import ConnectorContext, group_digests, log, spans
from .kv_pools import plan_block_ids
from .plan import TransferPlan
from .transport import TransferFailed, TransportError

if TYPE_CHECKING:
    from engine.kv_cache import PagedSequence
    from engine.scheduler import Scheduler

    from .transport import PendingConnect, PendingRead

_MIN_RENEW_S = 0.05
_IDLE_CHECK_S = 1.0


class LoadFailed(Exception):
    def __init__(self, reason: str, code: int = 503, digest: bool = False):
        super().__init__(reason)
        self.reason, self.code, self.digest = reason, code, digest


@dataclass(eq=False)
class _Load:
    req: object  # engine.request.Request
    kv: KVTransferParams
    plan: TransferPlan
    arrived: float
    renew_every: float
    next_renew: float
    seq: "PagedSequence | None" = None
    transfer: "PendingRead | None" = None
    read_started: float = 0.0

    @property
    def peer(self) -> str:
        return self.kv.remote_engine_id

    @property
    def lease(self) -> str:
        return self.kv.remote_request_id


class DecodeSide:
    def __init__(self, ctx: ConnectorContext, scheduler: "Scheduler", vocab_size: int):
        self.ctx, self.scheduler, self.vocab_size = ctx, scheduler, vocab_size
        self.loads: dict[int, _Load] = {}  # request id → load, arrival order
        self._handshakes: dict[str, PendingConnect] = {}
        self._connect_started: dict[str, float] = {}
        self._draining: list[tuple[PendingRead, "PagedSequence"]] = []  # abandoned READs still in flight
        self._peer_used: dict[str, float] = {}
        self._next_idle_check = 0.0

    # ---- admission ----------------------------------------------------------------------------
    def add(self, request_id: int, prompt: list[int], params: SamplingParams, kv: KVTransferParams,
            multimodal=None):
        """Validate a remote-prefilled request against this engine's own prompt and layout, and
        queue its load. RequestError (→ 400) for anything that does not add up. `multimodal`:
        the prompt's images (engine/v41/vision/inputs.py), or only their positions when the leg
        came without them; then the replay must not reach an image span (it would need them)."""
        from engine.request import Request, RequestError

        ctx = self.ctx
        try:
            if ctx.key:
                wire.verify(kv, ctx.key)
            plan = ctx.plan(len(prompt))
            wire.check_for_decode(kv, prompt_token_ids=prompt, blocks=plan.blocks, compat_hash=ctx.compat,
                                  now=time.time())
        except wire.ProtocolError as exc:
            raise RequestError(str(exc)) from None
        self._check_request(request_id, prompt, params, kv)
        if _lacks_images(multimodal) and multimodal.meets(plan.resume_from, plan.num_tokens):
            raise RequestError(f"the decode recomputes prompt positions [{plan.resume_from}, {plan.num_tokens}) "
                               "(its window replay), which hold image spans: send the images on the decode leg too")
        now = time.monotonic()
        lifetime = max(_MIN_RENEW_S, kv.remote_blocks_expiry_time - time.time())
        req = Request(request_id, list(prompt), params)
        req.multimodal = multimodal
        load = _Load(req, kv, plan, now, max(_MIN_RENEW_S, lifetime / 3), now + max(_MIN_RENEW_S, lifetime / 3))
        self.loads[request_id] = load
        self._connect(kv)
        return load.req

    def _check_request(self, request_id: int, prompt: list[int], params: SamplingParams,
                       kv: KVTransferParams) -> None:
        from engine.request import RequestError

        # The prompt itself passed the edge validator at Engine.add_request (context fit, token ids);
        # the first token is the one id that comes from the prefill.
        if request_id in self.loads or request_id in self.scheduler.requests:
            raise RequestError(f"duplicate request id {request_id!r}")
        try:
            check_token_ids([kv.remote_first_token], self.vocab_size)
        except TokenOutsideVocabulary as exc:
            raise RequestError(f"kv_transfer_params: remote_first_token {exc.token_id} is outside the "
                               f"vocabulary [0, {exc.vocab_size})") from None
        if params.logprobs is not None:
            top = kv.remote_first_top_logprobs or []
            if kv.remote_first_logprob is None or len(top) < params.logprobs:
                raise RequestError("kv_transfer_params: the prefill did not compute the first token's logprobs "
                                   f"(top {params.logprobs} asked for); send logprobs on the prefill leg too")

    def _connect(self, kv: KVTransferParams) -> None:
        peer, transport = kv.remote_engine_id, self.ctx.transport
        self._peer_used[peer] = time.monotonic()
        if peer in self._handshakes or transport.is_connected(peer):
            return
        self._connect_started[peer] = time.monotonic()
        self._handshakes[peer] = transport.start_connect(peer, kv.remote_host, kv.remote_port, self.ctx.compat,
                                                         self.ctx.config.connect_timeout_s)

    # ---- the loop -----------------------------------------------------------------------------
    def tick(self) -> tuple[list[TokenDelta], list[Finished]]:
        """Advance every load one stage where it can; the deltas and finishes that produced."""
        deltas, finished = [], []
        now = time.monotonic()
        self._drain()
        failed_peers = self._poll_handshakes()
        blocked = False  # FIFO: once a load cannot get blocks, later ones wait behind it
        for load in list(self.loads.values()):
            try:
                if load.peer in failed_peers and load.transfer is None:
                    raise LoadFailed(failed_peers[load.peer])
                blocked = self._advance(load, now, blocked)
                if load.transfer is not None and load.transfer.state == "done":
                    delta, done = self._complete(load)
                    deltas.append(delta)
                    if done is not None:
                        finished.append(done)
            except LoadFailed as exc:
                done = self._fail(load, exc)
                if done is not None:
                    finished.append(done)
        self._renew(now)
        self._drop_idle_peers(now)
        return deltas, finished

    def _advance(self, load: _Load, now: float, blocked: bool) -> bool:
        """One load's next stages; returns whether allocation is blocked for the loads behind it."""
        if load.seq is None:
            if blocked:
                return True
            if not self._allocate(load):
                if now - load.arrived > self.ctx.config.max_hold_s:
                    raise LoadFailed(f"no KV blocks free for {now - load.arrived:.0f} s", 503)
                return True
        if load.transfer is None:
            if load.peer in self._handshakes or not self.ctx.transport.is_connected(load.peer):
                if load.peer not in self._handshakes:  # the connection went away: connect again
                    self._connect(load.kv)
                return blocked
            self._post(load)
        try:
            load.transfer.poll()
        except TransferFailed as exc:
            raise LoadFailed(f"{exc} (prefill {load.peer} died or is unreachable)") from None
        return blocked

    def _allocate(self, load: _Load) -> bool:
        cache, plan = self.ctx.cache, load.plan
        seq = cache.new_sequence()
        # Positions [resume_from, n) writable (and the window before them readable): exactly
        # the logical blocks the plan names, plus what the replay (if any) writes.
        if not cache.manager.allocate(seq.table, plan.resume_from, plan.num_tokens):
            return False
        load.seq = seq
        if load.req.multimodal is not None:  # the replay places (or, for Engram, masks) image positions
            seq.multimodal = load.req.multimodal
        if plan.resume_from < plan.num_tokens:
            self._prepare_replay(seq, plan, load.req.prompt_token_ids)
        return True

    def _prepare_replay(self, seq: "PagedSequence", plan: TransferPlan, prompt: list[int]) -> None:
        """Set up recomputing [resume_from, n) on the global records the READ brings: those
        stay the prefill's (the replay's writes below n are dropped, as for a prefix-cache
        hit); the sliding rows the replay reads before its first position are zeros, not a
        recycled block's bytes; per-sequence token state (V4.1's Engram history) is rebuilt
        from the prompt below the resume point."""
        cache, start = self.ctx.cache, plan.resume_from
        seq.table.frozen_tokens = plan.num_tokens
        cache.zero_sliding(seq, seq.table.sliding_first * cache.layout.block_size, start)
        rebuild = getattr(cache, "rebuild_history", None)
        if rebuild is not None:
            rebuild(seq, prompt, start)

    def _poll_handshakes(self) -> dict[str, str]:
        """Advance every connection in progress; {peer: why} for those that failed."""
        failed = {}
        for peer, hs in list(self._handshakes.items()):
            try:
                if hs.poll() == "done":
                    del self._handshakes[peer]
                    self.ctx.counters.last_connect_s = time.monotonic() - self._connect_started.pop(peer, 0.0)
            except TransportError as exc:
                del self._handshakes[peer]
                self._connect_started.pop(peer, None)
                failed[peer] = f"cannot connect to prefill {peer}: {exc}"
        return failed

    def _post(self, load: _Load) -> None:
        """Post the READ of exactly the planned spans, from the prefill's blocks into ours."""
        kv, plan = load.kv, load.plan
        local = spans(plan, plan_block_ids(load.seq.table, plan.blocks))
        remote = spans(plan, {g: kv.group_blocks(g)[0] for g in GROUPS})
        items = [(pool, lo[1], ro[1], lo[2], lo[3]) for pool in local for lo, ro in zip(local[pool], remote[pool])]
        notify = wire.encode_notification(wire.KVDone([load.lease]))
        load.read_started = time.monotonic()
        try:
            load.transfer = self.ctx.transport.read_spans(load.peer, items, notify, self.ctx.config.transfer_timeout_s)
        except (KeyError, ValueError) as exc:  # block ids outside the prefill's pools
            raise LoadFailed(f"kv_transfer_params name blocks the prefill does not have: {exc}", 502) from None

    # ---- outcomes -----------------------------------------------------------------------------
    def _complete(self, load: _Load) -> tuple[TokenDelta, Finished | None]:
        """The READ is done: verify every block, then hand the request to the scheduler."""
        ctx, kv, req = self.ctx, load.kv, load.req
        t = load.transfer
        verify_start = time.monotonic()
        got = group_digests(ctx.cache, load.plan, plan_block_ids(load.seq.table, load.plan.blocks))
        bad = [f"{g} block #{i}" for g in GROUPS
               for i, (have, want) in enumerate(zip(got[g], kv.group_blocks(g)[1])) if have != want]
        if bad:
            raise LoadFailed(f"{len(bad)} transferred block(s) fail their digest ({', '.join(bad[:4])}): the KV "
                             "is corrupt and was not used", 502, digest=True)
        c = ctx.counters
        c.loaded += 1
        c.bytes_read += t.nbytes
        c.read_s += t.finished - t.started
        c.last_read_s, c.last_verify_s, c.last_bytes = t.finished - t.started, time.monotonic() - verify_start, t.nbytes
        del self.loads[req.request_id]
        return self._admit(load)

    def _admit(self, load: _Load) -> tuple[TokenDelta, Finished | None]:
        from engine.request import RequestError

        req, kv, params = load.req, load.kv, load.req.params
        req.seq, load.seq = load.seq, None
        req.num_computed_tokens = load.plan.resume_from
        token = kv.remote_first_token
        req.token_ids.append(token)
        delta = TokenDelta(req.request_id, [token])
        if params.logprobs is not None:
            delta = TokenDelta(req.request_id, [token], [kv.remote_first_logprob],
                               [list(kv.remote_first_top_logprobs[: params.logprobs])])
        reason = self._first_token_ends(token, params)
        if reason is None:
            try:
                self.scheduler.add(req)
                return delta, None
            except RequestError as exc:
                reason, error = "error", str(exc)
        else:
            error = None
        self.ctx.cache.free(req.seq)
        req.seq = None
        return delta, Finished(req.request_id, reason, req.num_prompt_tokens, 1, error, 400 if error else 0,
                               req.queued_s)

    def _first_token_ends(self, token: int, params: SamplingParams) -> str | None:
        """The scheduler's stop rules applied to the first output token."""
        if (token in self.scheduler.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        return "length" if params.max_tokens <= 1 else None

    def _fail(self, load: _Load, exc: LoadFailed) -> Finished | None:
        c = self.ctx.counters
        c.failed += 1
        c.digest_failures += exc.digest
        self._discard(load, exc.reason)
        req = load.req
        if self.ctx.config.failure_policy == "recompute" and not _lacks_images(req.multimodal):
            log.warning("request %d: %s; recomputing its prompt here", req.request_id, exc.reason)
            c.recomputed += 1
            try:
                self.scheduler.add(req)
                return None
            except Exception as err:  # noqa: BLE001 - RequestError: refuse it like any other request
                return Finished(req.request_id, "error", req.num_prompt_tokens, 0, str(err), 400, req.queued_s)
        log.warning("request %d failed: %s", req.request_id, exc.reason)
        return Finished(req.request_id, "error", req.num_prompt_tokens, 0,
                        f"KV transfer from prefill {load.peer} failed: {exc.reason}", exc.code, req.queued_s)

    def abort(self, request_id: int) -> Finished | None:
        load = self.loads.get(request_id)
        if load is None:
            return None
        self._discard(load, "aborted")
        req = load.req
        return Finished(request_id, "abort", req.num_prompt_tokens, 0, None, 0, req.queued_s)

    def _discard(self, load: _Load, reason: str) -> None:
        """Forget a load: its blocks back (once no READ can write them), the prefill told."""
        self.loads.pop(load.req.request_id, None)
        t, seq = load.transfer, load.seq
        load.seq = None
        if seq is not None:
            if t is not None and t.state == "pending":
                self._draining.append((t, seq))  # the READ may still write these blocks
            else:
                self.ctx.cache.free(seq)
        if t is None or t.state != "done":  # a finished READ already told the prefill (its notify)
            self._tell(load.peer, wire.KVDone([load.lease], ok=False, reason=reason[:500]))

    def _drain(self) -> None:
        keep = []
        for t, seq in self._draining:
            try:
                if t.poll() == "pending":
                    keep.append((t, seq))
                    continue
            except TransferFailed:
                pass
            self.ctx.cache.free(seq)
        self._draining = keep

    # ---- leases and peers ---------------------------------------------------------------------
    def _renew(self, now: float) -> None:
        due: dict[str, list[str]] = {}
        for load in self.loads.values():
            if load.next_renew <= now and (load.transfer is None or load.transfer.state == "pending"):
                load.next_renew = now + load.renew_every
                due.setdefault(load.peer, []).append(load.lease)
            self._peer_used[load.peer] = now
        for peer, leases in due.items():
            for i in range(0, len(leases), wire.MAX_IDS_PER_NOTIFICATION):
                self._tell(peer, wire.KVRenew(leases[i:i + wire.MAX_IDS_PER_NOTIFICATION]))

    def _tell(self, peer: str, msg: wire.KVRenew | wire.KVDone) -> None:
        if not self.ctx.transport.is_connected(peer):
            return  # not connected (yet, or any more): a lease then just runs out
        try:
            self.ctx.transport.send_notification(peer, wire.encode_notification(msg))
        except TransportError as exc:
            log.info("cannot notify prefill %s: %s", peer, exc)

    def _drop_idle_peers(self, now: float) -> None:
        if now < self._next_idle_check:
            return
        self._next_idle_check = now + _IDLE_CHECK_S
        for peer in self.ctx.transport.peers():
            if now - self._peer_used.get(peer, 0.0) > self.ctx.config.idle_peer_s and peer not in self._busy_peers():
                self.ctx.transport.disconnect(peer, "idle", say_bye=True)
                self._peer_used.pop(peer, None)

    def _busy_peers(self) -> set[str]:
        return {load.peer for load in self.loads.values()} | {t.peer for t, _ in self._draining}

    # ---- state --------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.loads or self._draining or self._handshakes)

    def held_blocks(self) -> int:
        seqs = [load.seq for load in self.loads.values() if load.seq is not None] + [s for _, s in self._draining]
        return sum(len(s.table.full) + len(s.table.sliding) for s in seqs)

    def close(self) -> None:
        for load in list(self.loads.values()):
            self._discard(load, "decode server shutting down")
        for t, seq in self._draining:
            t.cancel("shutting down")
            self.ctx.cache.free(seq)
        self._draining.clear()


def _lacks_images(multimodal) -> bool:
    """A prompt with image spans whose images this leg was not sent (only their positions)."""
    return multimodal is not None and not hasattr(multimodal, "images")
