"""KV block allocation: reference-counted block ids per pool group, per-sequence block tables,
and content hashes of full token blocks for prefix caching.

A sequence's `BlockTable` maps logical block i (positions [i·B, (i+1)·B)) to a physical block id
in each group: `full` keeps every block since position 0; `sliding` keeps only the blocks that
overlap the trailing window (older ones are released as the sequence advances).

Running out of blocks is an ordinary outcome: `allocate` returns False and changes nothing, so
the caller (the scheduler) can preempt and retry. Nothing here raises on exhaustion.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .kv_layout import KVLayout


class BlockAllocator:
    """A fixed set of block ids with reference counts. Id 0 is reserved as the dummy block that
    padding rows (and CUDA-graph padding) point at; it is never handed out."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 blocks (1 usable + the dummy), got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self.free_ids: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free_ids)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh ids with refcount 1, or None (and no change) if fewer than n are free."""
        if n > len(self.free_ids):
            return None
        ids = [self.free_ids.popleft() for _ in range(n)]
        self.refcount[ids] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            if self.refcount[i] <= 0:
                raise RuntimeError(f"incref of free block {i}")
            self.refcount[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self.refcount[i] <= 0:
                raise RuntimeError(f"double free of block {i}")
            self.refcount[i] -= 1
            if self.refcount[i] == 0:
                self.free_ids.append(i)


@dataclass
class BlockTable:
    full: list[int] = field(default_factory=list)  # logical block i → id, for i = 0..
    # Trailing blocks only: logical blocks [sliding_first, sliding_first + len(sliding)).
    sliding: list[int] = field(default_factory=list)
    sliding_first: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of the full token blocks

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
    def _needs(self, table: BlockTable, start: int, end: int) -> tuple[int, int, int, int]:
        """(new full blocks, first sliding block wanted, sliding blocks to release, sliding blocks to add)."""
        b = self.block_size
        last = -(-end // b)  # one past the last logical block touched
        new_full = max(0, last - len(table.full))
        lo = max(0, start - self.keep) // b
        if not table.sliding:
            return new_full, lo, 0, last - lo
        release = min(max(0, lo - table.sliding_first), len(table.sliding))
        have_end = table.sliding_first + len(table.sliding)
        add = max(0, last - max(have_end, lo))
        return new_full, lo, release, add

    def can_allocate(self, table: BlockTable, start: int, end: int) -> bool:
        new_full, _, release, add = self._needs(table, start, end)
        return new_full <= self.full.num_free and add <= self.sliding.num_free + release

    def allocate(self, table: BlockTable, start: int, end: int) -> bool:
        """Make positions [start, end) writable (and the trailing window before `start` still
        readable). Returns False, changing nothing, if the blocks are not available."""
        b = self.block_size
        if (table.sliding and end <= len(table.full) * b and end <= (table.sliding_first + len(table.sliding)) * b
                and max(0, start - self.keep) // b <= table.sliding_first):
            return True  # most decode steps: every block is there and none slides out of the window
        new_full, lo, release, add = self._needs(table, start, end)
        if new_full == 0 and release == 0 and add == 0:
            return True
        if new_full > self.full.num_free or add > self.sliding.num_free + release:
            return False
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
        """Release every block the table holds (abort, finish or preemption)."""
        self.full.free(table.full)
        self.sliding.free(table.sliding)
        table.full.clear()
        table.sliding.clear()
        table.sliding_first = 0
        table.block_hashes.clear()

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Drop full blocks wholly beyond `num_tokens` (after rejected speculative tokens)."""
        keep = -(-num_tokens // self.block_size)
        if len(table.full) > keep:
            self.full.free(table.full[keep:])
            del table.full[keep:]
        del table.block_hashes[num_tokens // self.block_size :]
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

    @property
    def usage(self) -> float:
        """Fraction of growable (full-group) blocks in use."""
        return self.full.num_used / max(1, self.full.num_blocks - 1)
