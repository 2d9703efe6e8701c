"""Block manager properties: no double allocation, frees restore counts, refcounts, exhaustion."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockAllocator, BlockManager, BlockTable, block_hash
from engine.kv_layout import build_layout
from engine.v4.checkpoint import preset_config


def _manager(full: int, sliding: int, block_size: int = 16) -> BlockManager:
    layout = build_layout(preset_config("tiny"), "auto", "fp32", block_size)
    return BlockManager(layout, full, sliding, slack=4)


def _all_ids(tables: list[BlockTable], group: str) -> list[int]:
    ids = []
    for t in tables:
        ids.extend(t.full if group == "full" else t.sliding)
    return ids


ops = st.lists(st.tuples(st.sampled_from(["grow", "free", "truncate"]), st.integers(0, 5), st.integers(1, 70)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_the_books(operations):
    mgr = _manager(full=12, sliding=14)
    tables = [BlockTable() for _ in range(6)]
    lengths = [0] * 6
    for op, i, n in operations:
        t = tables[i]
        if op == "grow":
            before = (mgr.full.num_free, mgr.sliding.num_free, list(t.full), list(t.sliding), t.sliding_first)
            if mgr.allocate(t, lengths[i], lengths[i] + n):
                lengths[i] += n
            else:  # exhaustion is a plain False and changes nothing
                assert before == (mgr.full.num_free, mgr.sliding.num_free, t.full, t.sliding, t.sliding_first)
        elif op == "free":
            mgr.free(t)
            lengths[i] = 0
        else:
            keep = max(0, lengths[i] - min(n, 4))
            mgr.truncate(t, keep)
            lengths[i] = keep
        for group, alloc in (("full", mgr.full), ("sliding", mgr.sliding)):
            ids = _all_ids(tables, group)
            assert len(ids) == len(set(ids)), "a block is owned twice"
            assert 0 not in ids, "the dummy block was handed out"
            assert alloc.num_used == len(ids)
            assert sorted(i for i in range(alloc.num_blocks) if alloc.refcount[i] > 0) == sorted(ids)
    for t in tables:
        mgr.free(t)
    assert mgr.full.num_used == 0 and mgr.sliding.num_used == 0


def test_sliding_blocks_are_released_as_the_window_passes():
    mgr = _manager(full=40, sliding=8, block_size=16)
    t = BlockTable()
    for pos in range(0, 400, 10):
        assert mgr.allocate(t, pos, pos + 10)
        assert len(t.sliding) <= -(-mgr.keep // 16) + 2
        assert t.sliding_first * 16 <= max(0, pos - mgr.keep)
        assert (t.sliding_first + len(t.sliding)) * 16 >= pos + 10
    assert len(t.full) == 25


def test_refcounts_share_and_release():
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)
    alloc.incref(ids)
    alloc.free(ids)
    assert alloc.num_free == 1
    alloc.free(ids)
    assert alloc.num_free == 3
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(ids[:1])
    assert alloc.allocate(4) is None and alloc.num_free == 3


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=60))
def test_ids_come_never_used_first_then_least_recently_freed(ops):
    """The allocator's order against a plain queue of every id: never-used ids ascending, then
    freed ones in the order they were freed (the allocator keeps the never-used ones as a range)."""
    alloc, queue, held = BlockAllocator(12), list(range(1, 12)), []
    for take, n in ops:
        if take:
            ids = alloc.allocate(n)
            assert ids == (queue[:n] if n <= len(queue) else None)
            if ids is not None:
                del queue[:n]
                held += ids
        elif held:
            ids, held = held[:n], held[n:]
            alloc.free(ids)
            queue += ids
        assert alloc.num_free == len(queue) and alloc.num_used == len(held)


def test_a_budget_of_fifty_million_blocks_starts_without_listing_them():
    alloc = BlockAllocator(50_000_000)
    assert alloc.num_free == 50_000_000 - 1 and not alloc.free_ids
    assert alloc.allocate(3) == [1, 2, 3]
    alloc.free([2])
    assert alloc.num_free == 50_000_000 - 3 and list(alloc.free_ids) == [2]


def test_block_hashes_chain_and_are_salted():
    mgr = _manager(full=8, sliding=8)
    a, b, c = BlockTable(), BlockTable(), BlockTable()
    tokens = list(range(50))
    mgr.update_hashes(a, tokens)
    mgr.update_hashes(b, tokens[:40] + [999] * 10)
    mgr.update_hashes(c, tokens, salt=b"tenant-2")
    assert len(a.block_hashes) == 3  # 50 tokens = 3 full blocks of 16
    assert a.block_hashes[:2] == b.block_hashes[:2] and a.block_hashes[2] != b.block_hashes[2]
    assert not set(a.block_hashes) & set(c.block_hashes)
    assert block_hash(b"", tokens[:16]) == a.block_hashes[0]
