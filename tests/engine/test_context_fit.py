"""A context longer than the KV pool holds for one sequence could never be scheduled: the engine
caps its context length at what fits (so the edge refuses such a request with a 400), and a pool
too small for one sequence is refused at start."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import RequestError
from engine.weights import load_model
from ipc.messages import SamplingParams


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("tiny-upstream", index_topk=64), dtype=torch.float32, progress=False)


@pytest.mark.parametrize("blocks, block_size, drafts", [(6, 8, 0), (6, 8, 2), (9, 16, 0)])
def test_context_length_is_capped_at_what_one_sequence_can_hold(model, blocks, block_size, drafts):
    engine = Engine(model, EngineConfig(num_kv_blocks=blocks, block_size=block_size, max_num_seqs=2,
                                        max_num_batched_tokens=64, speculative_tokens=drafts))
    fits = (blocks - 1) * block_size - drafts  # block 0 is the dummy; a verify step writes `drafts` past the end
    assert engine.max_model_len == fits
    with pytest.raises(RequestError, match=f"context length \\({fits} tokens\\)"):
        engine.add_request(1, list(range(3, 3 + fits)), SamplingParams(max_tokens=1))
    engine.add_request(2, list(range(3, 3 + fits - 4)), SamplingParams(max_tokens=4, ignore_eos=True))
    steps = 0
    while engine.has_work:  # the longest request that is accepted does finish
        engine.step()
        steps += 1
        assert steps < 200
    assert engine.cache.manager.full.num_used == 0


def test_a_roomy_pool_keeps_the_configured_length(model):
    engine = Engine(model, EngineConfig(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64,
                                        kv_cache_memory_bytes=32 << 20, block_size=16))
    assert engine.max_model_len == 256
