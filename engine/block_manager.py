"""KV block allocation: reference-counted block ids per pool group, per-sequence block tables,
and content-addressed (prefix-cached) full blocks.

A sequence's `BlockTable` maps logical block i (positions [i·B, (i+1)·B)) to a physical block id
in each group: `full` keeps every block since position 0; `sliding` keeps only the blocks that
overlap the trailing window (older ones are released as the sequence advances).

Prefix caching: a full block whose records are final can be *registered* under the hash chain
of its tokens. When its last reference goes it stays cached but evictable: it sits in the free
queue (oldest first) and is reused by content (`touch`) until `allocate` hands it out again,
which forgets its hash first. So a block is never given out while referenced, and a hash never
names a block whose content changed.

Running out of blocks is an ordinary outcome: `allocate` returns False and changes nothing, so
the caller (the scheduler) can preempt and retry. Nothing here raises on exhaustion.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .kv_layout import KVLayout


NO_HOLD = 1 << 62


class BlockAllocator:
    """A fixed set of block ids with reference counts. Id 0 is reserved as the dummy block that
    padding rows (and CUDA-graph padding) point at; it is never handed out.

    Free ids wait in a queue, least recently freed first, behind the ids never handed out (kept
    as a range, not listed: a tiny model's budget can hold tens of millions of blocks); a free id
    may still hold a cached block (`cached` maps its content hash to it). `allocate` takes from
    the front, evicting."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 blocks (1 usable + the dummy), got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self.next_fresh = 1  # ids [next_fresh, num_blocks) were never handed out (all free)
        self.free_ids: OrderedDict[int, None] = OrderedDict()  # ids handed out and freed since
        self.cached: dict[bytes, int] = {}  # content hash → block id (referenced or free)
        self.hash_of: dict[int, bytes] = {}  # the inverse
        self.on_evict: Callable[[bytes], None] | None = None  # told each hash that stops being cached
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Ids `allocate` can hand out: never used, freed, or cached but unreferenced."""
        return self.num_blocks - self.next_fresh + len(self.free_ids)

    @property
    def num_used(self) -> int:
        """Referenced ids (cached blocks nobody references do not count)."""
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached_free(self) -> int:
        """Cached blocks nobody references (evictable)."""
        return sum(1 for i in self.hash_of if self.refcount[i] == 0)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh ids with refcount 1, or None (and no change) if fewer than n are free."""
        if n > self.num_free:
            return None
        fresh = min(n, self.num_blocks - self.next_fresh)
        ids = list(range(self.next_fresh, self.next_fresh + fresh))
        self.next_fresh += fresh
        ids += [self.free_ids.popitem(last=False)[0] for _ in range(n - fresh)]
        for i in ids:
            if i in self.hash_of:
                self._forget(i)
        self.refcount[ids] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            if self.refcount[i] <= 0:
                raise RuntimeError(f"incref of free block {i}")
            self.refcount[i] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference each; ids reaching zero join the back of the free queue in the
        order given (so the caller decides which of its blocks are evicted first)."""
        for i in ids:
            if self.refcount[i] <= 0:
                raise RuntimeError(f"double free of block {i}")
            self.refcount[i] -= 1
            if self.refcount[i] == 0:
                self.free_ids[i] = None

    # ---- content-addressed blocks ----------------------------------------------------------
    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def touch(self, ids: list[int]) -> None:
        """Take a reference on cached blocks, reviving those that were free (a prefix hit)."""
        for i in ids:
            if i not in self.hash_of:
                raise RuntimeError(f"touch of uncached block {i}")
            if self.refcount[i] == 0:
                del self.free_ids[i]
            self.refcount[i] += 1

    def register(self, block: int, h: bytes) -> bool:
        """Name a referenced block whose content is final by its hash. False (nothing changes)
        when another block already holds that content or this block is already named."""
        if self.refcount[block] <= 0:
            raise RuntimeError(f"register of free block {block}")
        if h in self.cached or block in self.hash_of:
            return False
        self.cached[h] = block
        self.hash_of[block] = h
        return True

    def unregister(self, block: int) -> None:
        """Stop naming a block by content (its records are not to be trusted)."""
        if block in self.hash_of:
            self._forget(block)

    def _forget(self, block: int) -> None:
        h = self.hash_of.pop(block)
        del self.cached[h]
        self.num_evicted += 1
        if self.on_evict is not None:
            self.on_evict(h)


@dataclass
class BlockTable:
    full: list[int] = field(default_factory=list)  # logical block i → id, for i = 0..
    # Trailing blocks only: logical blocks [sliding_first, sliding_first + len(sliding)).
    sliding: list[int] = field(default_factory=list)
    sliding_first: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of the full token blocks
    # Prefix caching: full blocks [0, num_registered) are named by their hashes (shared, final);
    # full-group records of positions < frozen_tokens belong to cached blocks this sequence
    # adopted, and writes to them are dropped (a replay recomputes them, it must not change them).
    num_registered: int = 0
    frozen_tokens: int = 0
    # Position the step's own allocation started at: later allocations in the same step (MTP
    # drafts) keep the window it kept, so state at a boundary the step crossed stays readable
    # until the step is over (prefix-cache snapshots are taken then).
    sliding_hold: int = NO_HOLD

    def sliding_id(self, logical: int) -> int:
        return self.sliding[logical - self.sliding_first]


def block_hash(parent: bytes, tokens: list[int] | np.ndarray, salt: bytes = b"") -> bytes:
    """Content hash of one full token block, chained to its parent and salted per tenant so
    that tenants never share (or time) each other's cached prefixes."""
    h = hashlib.sha256()
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(parent)
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, layout: KVLayout, num_full_blocks: int, num_sliding_blocks: int, slack: int = 8):
        self.layout = layout
        self.block_size = layout.block_size
        self.slack = slack
        self.full = BlockAllocator(num_full_blocks)
        self.sliding = BlockAllocator(num_sliding_blocks)
        self.keep = layout.sliding_keep(slack)

    # ---- allocation ------------------------------------------------------------------------
    def _needs(self, table: BlockTable, keep_from: int, end: int) -> tuple[int, int, int, int]:
        """(new full blocks, first sliding block wanted, sliding blocks to release, sliding blocks
        to add) for writing up to `end` with the window before `keep_from` readable."""
        b = self.block_size
        last = -(-end // b)  # one past the last logical block touched
        new_full = max(0, last - len(table.full))
        lo = max(0, keep_from - self.keep) // b
        if not table.sliding:
            return new_full, lo, 0, last - lo
        release = min(max(0, lo - table.sliding_first), len(table.sliding))
        have_end = table.sliding_first + len(table.sliding)
        add = max(0, last - max(have_end, lo))
        return new_full, lo, release, add

    def can_allocate(self, table: BlockTable, start: int, end: int) -> bool:
        new_full, _, release, add = self._needs(table, min(start, table.sliding_hold), end)
        return new_full <= self.full.num_free and add <= self.sliding.num_free + release

    def allocate(self, table: BlockTable, start: int, end: int, hold: bool = False) -> bool:
        """Make positions [start, end) writable (and the trailing window before `start` still
        readable). `hold`: this is the step's own allocation (see `BlockTable.sliding_hold`).
        Returns False, changing nothing, if the blocks are not available."""
        b = self.block_size
        keep_from = start if hold else min(start, table.sliding_hold)
        if (table.sliding and end <= len(table.full) * b and end <= (table.sliding_first + len(table.sliding)) * b
                and max(0, keep_from - self.keep) // b <= table.sliding_first):
            if hold:
                table.sliding_hold = start
            return True  # most decode steps: every block is there and none slides out of the window
        new_full, lo, release, add = self._needs(table, keep_from, end)
        if new_full > self.full.num_free or add > self.sliding.num_free + release:
            return False
        if hold:
            table.sliding_hold = start
        if release:
            self.sliding.free(table.sliding[:release])
            del table.sliding[:release]
            table.sliding_first += release
        if not table.sliding:
            table.sliding_first = lo
        if new_full:
            table.full.extend(self.full.allocate(new_full))
        if add:
            table.sliding.extend(self.sliding.allocate(add))
        return True

    def free(self, table: BlockTable) -> None:
        """Release every block the table holds (abort, finish or preemption). Full blocks are
        freed last block first, so a cached prefix is evicted from its end, never its root."""
        self.full.free(table.full[::-1])
        self.sliding.free(table.sliding)
        table.full.clear()
        table.sliding.clear()
        table.sliding_first = 0
        table.block_hashes.clear()
        table.num_registered = table.frozen_tokens = 0
        table.sliding_hold = NO_HOLD

    def adopt(self, table: BlockTable, ids: list[int]) -> None:
        """Start an empty table on cached full blocks (a prefix hit): they become its logical
        blocks 0.. and read-only to it."""
        if table.full or table.sliding:
            raise RuntimeError("adopt needs an empty block table")
        self.full.touch(ids)
        table.full = list(ids)
        table.num_registered = len(ids)
        table.frozen_tokens = len(ids) * self.block_size

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Drop full blocks wholly beyond `num_tokens` (after rejected speculative tokens)."""
        keep = -(-num_tokens // self.block_size)
        if len(table.full) > keep:
            self.full.free(table.full[keep:])
            del table.full[keep:]
        del table.block_hashes[num_tokens // self.block_size :]
        table.num_registered = min(table.num_registered, len(table.full))
        beyond = table.sliding_first + len(table.sliding) - max(keep, table.sliding_first)
        if beyond > 0:
            self.sliding.free(table.sliding[-beyond:])
            del table.sliding[-beyond:]

    # ---- prefix hashes ---------------------------------------------------------------------
    def update_hashes(self, table: BlockTable, token_ids: list[int], salt: bytes = b"") -> None:
        """Extend the table's hash chain over every full block of `token_ids` (its known tokens)."""
        b = self.block_size
        for i in range(len(table.block_hashes), len(token_ids) // b):
            parent = table.block_hashes[-1] if table.block_hashes else b""
            table.block_hashes.append(block_hash(parent, token_ids[i * b : (i + 1) * b], salt))

    def match(self, hashes: list[bytes]) -> list[int]:
        """Ids of the cached blocks holding the longest leading run of `hashes`."""
        ids = []
        for h in hashes:
            i = self.full.lookup(h)
            if i is None:
                break
            ids.append(i)
        return ids

    def register(self, table: BlockTable, num_blocks: int) -> None:
        """Name full blocks [num_registered, num_blocks) by their hashes (their records are
        final: every position they cover is computed). The table's hash chain must reach them."""
        for i in range(table.num_registered, num_blocks):
            self.full.register(table.full[i], table.block_hashes[i])
        table.num_registered = max(table.num_registered, num_blocks)

    @property
    def usage(self) -> float:
        """Fraction of growable (full-group) blocks in use."""
        return self.full.num_used / max(1, self.full.num_blocks - 1)
