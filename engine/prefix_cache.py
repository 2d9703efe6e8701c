"""Prefix caching over the hybrid KV cache: which cached blocks a request reuses, how its
sliding state is rebuilt at the hit, and what it leaves behind for later requests.

The full (global) pools are content-addressed by block (engine/block_manager.py): a full block
is registered under the hash chain of its tokens (salted by model, KV dtype, block size and the
request's `cache_salt`) once every position it covers is computed, and stays cached, evictable,
after its request ends. The sliding pools (window KV, compressor partial windows) are per
sequence, so a hit on tokens [0, H) also needs the sliding state at a position S ≤ H, from which
the request is computed on. Three ways to get it:

  * restore (exact mode): a snapshot of the rows computing from a block boundary reads
    (engine/kv_snapshot.py), taken by an earlier request when it crossed that boundary; S is
    the boundary, nothing is recomputed. Snapshots are kept at two boundaries per request: the
    last one inside its prompt (where the next turn of a conversation usually diverges) and
    the last one it computed (where a resent conversation continues).
  * exact replay (exact mode, no snapshot at the hit): recompute [S, H) with S = H − R rounded
    down to a block, R the receptive field of the window stack: a window row of layer l at p
    depends on layer l−1 at [p − W + 1, p], so with n sequential window layers R = (n − 1)·(W − 1)
    + the rows the last layer reads before H (V4.1's DSpark stages are not in the sequence: each
    reads only backbone states at its own positions, `_chained_window_layers`). Rows before S
    read as zeros; the error they cause spreads W − 1 positions per layer and stops short of H.
  * bounded replay (`--prefix-replay bounded`, vLLM's approximation): recompute the last W_b
    tokens before H (W_b = the window rounded up to every compress ratio: 128 for V4/V4.1), not
    exact. Keeps no snapshots.
Images (DeepSeek-V4.1 vision): every position of an image span carries the same token id, so a
block's key also folds in the content digest of each image whose span starts in it (`_extend_hashes`);
the chain carries it into every later block, so two requests with the same text and different
images never share a block from the first one that holds an image position on.
Per-sequence state that is a function of the tokens alone (V4.1's Engram compressed-id history)
is rebuilt by the cache from the token ids below S (`rebuild_history`), for restores and replays
alike. While a request recomputes positions below H their global records are not written: those
blocks are shared and final (`BlockTable.frozen_tokens`). Hits are full blocks only, and the last
known token is always computed, so the sampled token has logits.

Prefill/decode hand-off (`resume`): the decode side puts blocks holding the global records of
[0, H) into a fresh sequence's table and either the prefill side's `SlidingState` at H
(`export_state`) or nothing, and is told where to compute from.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass

from .block_manager import block_hash
from .config import PREFIX_REPLAY_MODES
from .kv_snapshot import SlidingState, boundary_rows, export_state, import_state
from .models import registry
from .v41.vision.inputs import multimodal_of


@dataclass
class PrefixCacheStats:
    """Cumulative counters. `queries`/`hits` are vLLM's prefix_cache_queries/hits (tokens, first
    admissions only); a hit counts the tokens that were not computed."""

    queries: int = 0
    hits: int = 0
    hit_requests: int = 0
    restores: int = 0  # hits resumed from a snapshot
    replays: int = 0  # hits resumed by recomputing below the cached length
    replayed_tokens: int = 0  # cached tokens recomputed (the replay cost), every admission
    snapshots_saved: int = 0


@dataclass(frozen=True, slots=True)
class Hit:
    blocks: list[int]  # cached full blocks adopted as logical blocks 0..: tokens [0, cached_tokens)
    cached_tokens: int
    start: int  # first position computed
    slot: int | None  # snapshot restored at `start`; None = replay from `start`


@dataclass
class RequestPrefix:
    """A request's prefix-cache bookkeeping (kept across preemptions)."""

    salt: bytes
    seen: int = 0  # last block boundary its state was checked at
    trusted_from: int = 0  # boundaries ≥ this hold exact sliding state (may be snapshot)
    adopted: int = 0  # blocks adopted at its current admission
    prompt_saved: bool = False
    tail_slot: int | None = None  # owned snapshot of the last boundary it computed past its prompt's
    tail_key: bytes | None = None


@dataclass
class _Slot:
    key: bytes
    next_token: int | None


class PrefixCache:
    def __init__(self, cache, mode: str = "exact", model_salt: bytes = b"", speculative: bool = False):
        if mode not in PREFIX_REPLAY_MODES:
            raise ValueError(f"--prefix-replay must be one of {', '.join(PREFIX_REPLAY_MODES)}, got {mode!r}")
        self.cache, self.mode, self.model_salt = cache, mode, model_salt
        self.manager = cache.manager
        self.block_size = cache.layout.block_size
        # MTP window rows at H − 1 were computed with token H: a snapshot serves only requests
        # with the same token there when drafts read them.
        self.speculative = speculative
        self.store = cache.snapshots if mode == "exact" else None
        layout = cache.layout
        self.lookback = max(boundary_rows(layout).values(), default=0)
        self.receptive_field = receptive_field(cache)
        ratios = [p.tokens_per_record for p in layout.pools if p.group == "full"]
        step = math.lcm(*ratios) if ratios else 1
        self.bounded_tokens = -(-max(self.lookback, 1) // step) * step
        self.stats = PrefixCacheStats()
        # Snapshot slots: free ones, committed ones by key (least recently used first).
        n = self.store.num_slots if self.store is not None else 0
        self._free_slots = list(range(n - 1, -1, -1))
        self._slots: dict[int, _Slot] = {}
        self._by_key: OrderedDict[bytes, int] = OrderedDict()
        self.manager.full.on_evict = self._block_evicted

    @classmethod
    def for_engine(cls, cache, model_cfg, kv_dtype: str, mode: str, speculative: bool) -> "PrefixCache":
        """`speculative`: drafts read window rows computed with the token after them (V4's MTP).
        V4.1's DSpark windows hold main positions' rows only (no look-ahead token), so a
        snapshot serves any next token: pass False there."""
        salted = registry.of(model_cfg).capabilities.salt_names_pool_formats
        formats = _pool_formats(cache.layout) if salted else None
        return cls(cache, mode, model_salt(model_cfg, kv_dtype, cache.layout.block_size, formats), speculative)

    # ---- lookup ----------------------------------------------------------------------------
    def salt(self, cache_salt: str | None) -> bytes:
        tenant = cache_salt.encode() if cache_salt else b""
        return self.model_salt + len(tenant).to_bytes(4, "little") + tenant

    def state(self, req) -> RequestPrefix:
        if req.prefix is None:
            req.prefix = RequestPrefix(self.salt(req.params.cache_salt))
        return req.prefix

    def match(self, req) -> Hit | None:
        """The best hit for `req` (its sequence must hold no blocks), or None. Changes nothing
        but the sequence's hash chain."""
        b, tokens, table = self.block_size, req.token_ids, req.seq.table
        limit = (len(tokens) - 1) // b  # the last known token is always computed
        if limit <= 0:
            return None
        self._extend_hashes(req, tokens[: limit * b])
        blocks = self.manager.match(table.block_hashes[:limit])
        if not blocks:
            return None
        cached = len(blocks) * b
        start, slot = self._replay_start(cached), None
        if self.store is not None:
            for i in range(len(blocks), 0, -1):
                if i * b <= start:
                    break
                found = self._lookup_slot(table.block_hashes[i - 1], tokens[i * b])
                if found is not None:
                    start, slot = i * b, found
                    break
        return Hit(blocks, cached, start, slot) if start > 0 else None

    def _extend_hashes(self, req, tokens: list[int]) -> None:
        """Extend the request's block-hash chain over every full block of `tokens`; with images,
        each block's salt also holds the digests of the images whose spans start in it."""
        table, salt = req.seq.table, self.state(req).salt
        images = multimodal_of(req)
        if images is None:
            self.manager.update_hashes(table, tokens, salt)
            return
        b = self.block_size
        for i in range(len(table.block_hashes), len(tokens) // b):
            parent = table.block_hashes[-1] if table.block_hashes else b""
            extra = images.digests_starting_in(i * b, (i + 1) * b)
            table.block_hashes.append(block_hash(parent, tokens[i * b: (i + 1) * b], salt + extra))

    def _replay_start(self, cached: int) -> int:
        if self.mode == "bounded":
            return max(0, cached - self.bounded_tokens)
        return max(0, (cached - self.receptive_field) // self.block_size * self.block_size)

    def _lookup_slot(self, key: bytes, next_token: int) -> int | None:
        slot = self._by_key.get(key)
        if slot is None or (self.speculative and self._slots[slot].next_token != next_token):
            return None
        return slot

    # ---- admission -------------------------------------------------------------------------
    def adopt(self, req, hit: Hit) -> None:
        """Put the hit's blocks in the request's (empty) table and move it to `hit.start`."""
        self.manager.adopt(req.seq.table, hit.blocks)
        req.num_computed_tokens = hit.start

    def undo(self, req) -> None:
        """The request could not be admitted after `adopt`: give the blocks back."""
        self.manager.free(req.seq.table)
        req.num_computed_tokens = 0

    def admitted(self, req, hit: Hit | None) -> None:
        """The request's blocks for its first step are allocated: rebuild its sliding state
        below `hit.start` (restore or zeros) and count the query."""
        pre = self.state(req)
        first = req.num_preemptions == 0
        if first:
            self.stats.queries += req.num_prompt_tokens
        pre.seen = req.num_computed_tokens // self.block_size * self.block_size
        pre.trusted_from = 0
        pre.adopted = len(hit.blocks) if hit is not None else 0
        if hit is None:
            return
        self._rebuild(req.seq, hit.start, hit.slot)
        self._rebuild_history(req.seq, req.token_ids, hit.start)
        pre.trusted_from = hit.start if hit.slot is not None else hit.cached_tokens
        self.stats.replayed_tokens += hit.cached_tokens - hit.start
        if hit.slot is not None:
            self.stats.restores += 1
        else:
            self.stats.replays += 1
        if first:
            self.stats.hits += hit.start
            self.stats.hit_requests += 1

    def _rebuild(self, seq, start: int, slot: int | None) -> None:
        if slot is not None:
            self.store.restore(slot, seq, start)
            self._by_key.move_to_end(self._slots[slot].key)
        else:
            self.cache.zero_sliding(seq, seq.table.sliding_first * self.block_size, start)

    def _rebuild_history(self, seq, token_ids: list[int], start: int) -> None:
        """Per-sequence state that is a function of the tokens alone (V4.1's Engram history):
        the cache rebuilds what computing from `start` reads of it."""
        rebuild = getattr(self.cache, "rebuild_history", None)
        if rebuild is not None:
            rebuild(seq, token_ids, start)

    # ---- progress --------------------------------------------------------------------------
    def on_computed(self, req) -> None:
        """After a step: register the full blocks it completed; snapshot a boundary it crossed."""
        b, table = self.block_size, req.seq.table
        done = req.num_computed_tokens // b
        if done > table.num_registered:
            self._extend_hashes(req, req.token_ids[: done * b])
            self.manager.register(table, done)
        if self.store is None:
            return
        pre, end = self.state(req), done * b
        if end <= pre.seen:
            return
        crossed, pre.seen = (pre.seen, end), end
        prompt_end = req.num_prompt_tokens // b * b
        if not pre.prompt_saved and crossed[0] < prompt_end <= end:
            pre.prompt_saved = self._save_shared(req, prompt_end)
        if end > prompt_end and end >= pre.trusted_from:
            self._save_tail(req, end)

    def _save_shared(self, req, end: int) -> bool:
        """Snapshot at a boundary that stays final (the prompt's): committed at once."""
        if end < self.state(req).trusted_from:
            return False
        key = req.seq.table.block_hashes[end // self.block_size - 1]
        if key in self._by_key:
            self._by_key.move_to_end(key)
            return True
        slot = self._take_slot()
        if slot is None or not self._copy_out(req, slot, end):
            if slot is not None:
                self._free_slots.append(slot)
            return False
        self._commit(slot, key, self._next_token(req, end))
        return True

    def _save_tail(self, req, end: int) -> None:
        """Snapshot the latest boundary into the request's own slot (committed at release)."""
        pre = self.state(req)
        if pre.tail_slot is None:
            pre.tail_slot = self._take_slot()
            if pre.tail_slot is None:
                return
        if self._copy_out(req, pre.tail_slot, end):
            pre.tail_key = req.seq.table.block_hashes[end // self.block_size - 1]
            self._slots[pre.tail_slot] = _Slot(pre.tail_key, self._next_token(req, end))
        else:
            pre.tail_key = None

    def _copy_out(self, req, slot: int, end: int) -> bool:
        table = req.seq.table
        if not table.sliding or max(0, end - self.lookback) < table.sliding_first * self.block_size:
            return False  # no longer readable: the window moved on
        self.store.save(slot, req.seq, end)
        self.stats.snapshots_saved += 1
        return True

    @staticmethod
    def _next_token(req, end: int) -> int | None:
        return req.token_ids[end] if end < len(req.token_ids) else None

    # ---- release ---------------------------------------------------------------------------
    def release(self, req, failed: bool = False) -> None:
        """The request gives its blocks back (finish, abort, preemption; the caller frees them).
        Its tail snapshot becomes shared; a failed request's own blocks and snapshot are dropped
        (their records may hold what made it fail)."""
        pre = req.prefix
        if pre is None:
            return
        slot, key = pre.tail_slot, pre.tail_key
        pre.tail_slot = pre.tail_key = None
        if failed and req.seq is not None:
            table = req.seq.table
            for i in range(pre.adopted, table.num_registered):
                self.manager.full.unregister(table.full[i])
        if slot is None:
            return
        if failed or key is None or key in self._by_key:
            self._slots.pop(slot, None)
            self._free_slots.append(slot)
            return
        self._commit(slot, key, self._slots[slot].next_token)

    # ---- snapshot slots --------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        if self._by_key:  # evict the least recently used committed snapshot
            _, slot = self._by_key.popitem(last=False)
            del self._slots[slot]
            return slot
        return None

    def _commit(self, slot: int, key: bytes, next_token: int | None) -> None:
        self._slots[slot] = _Slot(key, next_token)
        self._by_key[key] = slot

    def _block_evicted(self, key: bytes) -> None:
        """A cached full block was handed out again: a snapshot keyed by it is unreachable."""
        slot = self._by_key.pop(key, None)
        if slot is not None:
            del self._slots[slot]
            self._free_slots.append(slot)

    @property
    def num_snapshots(self) -> int:
        return len(self._by_key)

    # ---- prefill → decode hand-off ---------------------------------------------------------
    def export(self, seq, end: int) -> SlidingState:
        """Prefill side: the sliding state of `seq` at block boundary `end` (computed, still
        readable), to send with the global blocks of [0, end)."""
        return export_state(self.cache, seq, end)

    def resume(self, seq, cached_tokens: int, state: SlidingState | None = None,
               token_ids: list[int] | None = None) -> int | None:
        """Decode side: `seq.table.full` holds blocks with the global records of [0,
        cached_tokens) (a multiple of the block size) and nothing else is set up. Allocates the
        sliding blocks, imports `state` (taken at cached_tokens) or prepares a replay, and
        returns the first position to compute (None: no sliding blocks free; nothing changed).
        The records below cached_tokens are not rewritten by the replay. `token_ids` (the
        sequence's known tokens) rebuild per-sequence token state (V4.1's Engram history)."""
        b, table = self.block_size, seq.table
        if cached_tokens % b or len(table.full) * b < cached_tokens or table.sliding:
            raise ValueError(f"resume needs a table of full blocks covering {cached_tokens} tokens (a multiple of "
                             f"{b}) and no sliding blocks")
        start = cached_tokens if state is not None else self._replay_start(cached_tokens)
        if not self.manager.allocate(table, start, start):
            return None
        table.frozen_tokens = cached_tokens
        if state is not None:
            if state.end != cached_tokens:
                raise ValueError(f"state taken at {state.end}, blocks cover {cached_tokens}")
            import_state(self.cache, seq, state)
        else:
            self.cache.zero_sliding(seq, table.sliding_first * b, start)
        if token_ids is not None:
            self._rebuild_history(seq, token_ids, start)
        return start


def receptive_field(cache) -> int:
    """R: how many positions before H an exact replay recomputes, so that every sliding row it
    leaves at H is what a cold run has (used by prefix-cache hits and by PD's V4.1 replay)."""
    rows = boundary_rows(cache.layout)
    windows = [p for p in cache.layout.pools if p.group == "sliding" and not p.name.startswith("state_")]
    window_rows = max((rows[p.name] for p in windows), default=0)
    return max(0, _chained_window_layers(cache, windows) - 1) * window_rows + max(rows.values(), default=0)


def _chained_window_layers(cache, windows) -> int:
    """How many window layers feed one another in sequence (the n of R = (n − 1)·(W − 1) + …).

    V4's MTP layer reads the backbone's last output at p (itself exact from S + n·(W − 1)), so
    it chains on as one more layer. V4.1's DSpark stages (window-pool layers num_layers + s)
    write rows at q from the backbone's attention inputs of its target layers at q alone
    (engine/v41/dspark.py `observe`), never from another stage: those inputs are exact from
    S + t·(W − 1) for a target t ≤ n − 1, so a stage's rows before H are exact wherever the
    backbone's last layer's are, and the stages add no depth."""
    layers = set().union(*(p.layers for p in windows)) if windows else set()
    cfg = getattr(cache, "cfg", None)
    if cfg is not None:
        layers = registry.of(cfg).chained_window_layers(cfg, layers)
    return len(layers)


def model_salt(model_cfg, kv_dtype: str, block_size: int, pool_formats: dict[str, str] | None = None) -> bytes:
    """What makes cached records differ besides tokens: the model, the KV format, the block size.
    `pool_formats` (V4.1: every pool's record format, index keys included, which `kv_dtype`
    alone does not name) go in too; the model config carries the architecture, so V4 and V4.1
    salts differ even for the same `kv_dtype`."""
    fields = {"model": asdict(model_cfg), "kv_dtype": kv_dtype, "block_size": block_size}
    if pool_formats is not None:
        fields["pool_formats"] = pool_formats
    doc = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).digest()[:16]


def _pool_formats(layout) -> dict[str, str]:
    return {p.name: p.fmt for p in layout.pools}


def snapshot_slots(enabled: bool, mode: str, slots: int | None, max_num_seqs: int) -> int:
    """Snapshots to preallocate: none when caching is off or bounded, else `slots` or 4 per
    sequence slot (each running request owns at most one; the rest are shared)."""
    if not enabled or mode != "exact":
        return 0
    return 4 * max_num_seqs if slots is None else slots


__all__ = ["Hit", "PREFIX_REPLAY_MODES", "PrefixCache", "PrefixCacheStats", "RequestPrefix", "SlidingState",
           "model_salt", "snapshot_slots"]
