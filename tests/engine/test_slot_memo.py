"""The per-sequence path's slot tensors: memoised per range (one build per step, not per layer)
and never stale when the block table changes."""

from __future__ import annotations

import random

import pytest
import torch

from engine import kv_cache
from engine.block_manager import BlockTable
from engine.engine import Engine
from engine.config import EngineConfig
from engine.weights import load_model
from ipc.messages import SamplingParams

BLOCK = 4


def sliding_slots(table: BlockTable, start: int, end: int) -> list[int]:
    """Position p lives in sliding block p // BLOCK at offset p % BLOCK (the plain definition)."""
    return [table.sliding[p // BLOCK - table.sliding_first] * BLOCK + p % BLOCK for p in range(start, end)]


def full_slots(table: BlockTable, first: int, end: int, per_record: int) -> list[int]:
    per_block = BLOCK // per_record
    return [table.full[w // per_block] * per_block + w % per_block for w in range(first, end)]


def test_memoised_slots_follow_every_table_change():
    """Appends, released front blocks and blocks swapped in place (a freed and reused table):
    every answer equals the plain definition, although each range is asked for many times."""
    rng = random.Random(0)
    table = BlockTable(full=[3, 9], sliding=[5, 2], sliding_first=0)
    slots = kv_cache.Slots(table, BLOCK, "cpu")
    for _ in range(400):
        op = rng.random()
        if op < 0.2:
            table.full.append(rng.randrange(64))
            table.sliding.append(rng.randrange(64))
        elif op < 0.3 and len(table.sliding) > 1:
            table.sliding.pop(0)
            table.sliding_first += 1
        elif op < 0.4:
            table.full[rng.randrange(len(table.full))] = rng.randrange(64)
            table.sliding[rng.randrange(len(table.sliding))] = rng.randrange(64)
        lo = table.sliding_first * BLOCK
        hi = (table.sliding_first + len(table.sliding)) * BLOCK
        start = rng.randrange(lo, hi)
        end = rng.randrange(start, hi + 1)
        assert slots.sliding(start, end).tolist() == sliding_slots(table, start, end)
        per_record = rng.choice([1, 2, 4])
        entries = len(table.full) * BLOCK // per_record
        first = rng.randrange(entries)
        last = rng.randrange(first, entries + 1)
        assert slots.full(first, last, per_record).tolist() == full_slots(table, first, last, per_record)
    assert len(slots._memo) <= kv_cache.Slots.MEMO_SIZE


def test_a_range_past_the_table_still_raises():
    table = BlockTable(full=[1], sliding=[2], sliding_first=0)
    slots = kv_cache.Slots(table, BLOCK, "cpu")
    with pytest.raises(IndexError):
        slots.full(0, BLOCK + 1, 1)
    with pytest.raises(IndexError):
        slots.sliding(0, BLOCK + 1)


def _builds_per_mixed_step(path) -> int:
    """Slot tensors built in one step that prefills a new prompt beside a decoding sequence."""
    model = load_model(path, dtype=torch.float32, progress=False)
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64,
                                        block_size=16, speculative_tokens=1, max_model_len=400))
    engine.add_request(0, list(range(3, 40)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request(1, list(range(5, 90)), SamplingParams(max_tokens=5, ignore_eos=True))
    builds = []
    real = kv_cache.Slots._memoised

    def counting(self, key, build):
        return real(self, key, lambda: builds.append(key) or build())
    kv_cache.Slots._memoised = counting
    try:
        engine.step()
    finally:
        kv_cache.Slots._memoised = real
    return len(builds)


def test_a_mixed_step_builds_each_range_once_not_once_per_layer(checkpoint_factory):
    """The same layer pattern stacked twice (8 layers instead of 4) builds no more slot tensors:
    the ranges of a step are the same in every layer."""
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
             "compressed_sparse_attention"]
    four = checkpoint_factory("memo-4-layers")
    eight = checkpoint_factory("memo-8-layers", num_hidden_layers=8, layer_types=kinds * 2,
                               mlp_layer_types=["hash_moe"] + ["moe"] * 7)
    assert _builds_per_mixed_step(eight) == _builds_per_mixed_step(four) > 0
