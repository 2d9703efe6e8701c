"""The model reading and writing KV through the shared paged pools."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache
from engine.weights import load_model
from ipc.messages import SamplingParams
from reference_driver import generate

PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)
LENGTHS = (41, 3, 17, 9, 26)
# A tiny geometry the quantized formats accept: 64 rope dims, 128-wide entries, 64-wide index keys.
QUANTIZABLE = dict(head_dim=128, qk_rope_head_dim=64, index_head_dim=64, index_topk=3)


def _prompts(vocab: int) -> list[list[int]]:
    return [torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in LENGTHS]


def _tokens(model, prompts, cache=None, budget=2048):
    return [g.token_ids for g in generate(model, prompts, PARAMS, cache=cache, max_batched_tokens=budget)]


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.float32, progress=False)


def test_paged_pools_equal_the_dense_state(model):
    """Small blocks (16 tokens) and a 7-token budget force block crossings and chunked prefill."""
    prompts = _prompts(model.cfg.vocab_size)
    cache = KVCache.for_model(model, "auto", max_num_seqs=len(prompts), max_tokens_per_step=7,
                              num_full_blocks=24, block_size=16)
    assert _tokens(model, prompts, cache, budget=7) == _tokens(model, prompts, budget=7)
    assert cache.manager.full.num_used == 0 and cache.manager.sliding.num_used == 0


def test_bf16_pages_equal_the_bf16_dense_state(checkpoint_factory):
    model = load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.bfloat16, progress=False)
    prompts = _prompts(model.cfg.vocab_size)
    cache = KVCache.for_model(model, "bf16", max_num_seqs=len(prompts), num_full_blocks=24, block_size=16)
    assert _tokens(model, prompts, cache) == _tokens(model, prompts)


def test_sequences_sharing_pools_equal_each_alone(model):
    prompts = _prompts(model.cfg.vocab_size)
    cache = KVCache.for_model(model, "auto", max_num_seqs=len(prompts), num_full_blocks=24, block_size=16)
    together = _tokens(model, prompts, cache)
    alone = [_tokens(model, [p], cache)[0] for p in prompts]
    assert together == alone


def test_exhausted_pool_is_reported_not_corrupted(model):
    cache = KVCache.for_model(model, "auto", max_num_seqs=1, num_full_blocks=3, block_size=16)
    seq = cache.new_sequence()
    assert cache.allocate(seq, 0, 32)
    assert not cache.allocate(seq, 32, 80)  # 2 usable blocks cover 32 tokens
    assert len(seq.table.full) == 2
    cache.free(seq)
    assert cache.manager.full.num_used == 0


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_quantized_pools_track_bf16(checkpoint_factory, kv_dtype):
    """Teacher-forced on the bf16-KV greedy path, fp8/fp4 KV keeps most top-1 choices."""
    model = load_model(checkpoint_factory("tiny-quantizable", **QUANTIZABLE), dtype=torch.float32, progress=False)
    prompt = _prompts(model.cfg.vocab_size)[0]
    ref_cache = KVCache.for_model(model, "bf16", max_num_seqs=1, num_full_blocks=16, block_size=16)
    path = generate(model, [prompt], SamplingParams(max_tokens=32, ignore_eos=True, logprobs=0), cache=ref_cache)[0]
    cache = KVCache.for_model(model, kv_dtype, max_num_seqs=1, num_full_blocks=16, block_size=16)
    assert cache.pools["c4"].tensors[1].dtype == torch.uint8
    seq = cache.new_sequence()
    ids = torch.tensor(prompt + path.token_ids)
    assert cache.allocate(seq, 0, len(ids))
    from engine.v4.attention import SeqSlice, SequenceContext

    logits = model.logits(model(ids, torch.arange(len(ids)), SequenceContext([SeqSlice(seq, 0, 0, len(ids))])))
    steps = logits[len(prompt) - 1 : -1]
    agree = (steps.argmax(-1) == torch.tensor(path.token_ids)).float().mean().item()
    delta = (torch.log_softmax(steps, -1).gather(1, torch.tensor(path.token_ids)[:, None]).squeeze(1)
             - torch.tensor(path.logprobs)).abs().mean().item()
    # Thresholds for a random tiny model (narrow logit gaps); perf/bench_kv_accuracy.py measures `small`.
    assert agree >= 0.5 and delta < 0.3, (agree, delta)


def test_kv_layout_of_released_v4_flash_matches_the_spec():
    from pathlib import Path

    from engine.config import ModelConfig
    from engine.kv_layout import build_layout

    cfg = ModelConfig.from_model_dir(Path(__file__).resolve().parents[2] / "engine/configs/deepseek-v4-flash.json")
    assert build_layout(cfg, "fp8").global_bytes_per_token == pytest.approx(21 * 584 / 4 + 21 * 68 / 4 + 20 * 584 / 128)
    assert build_layout(cfg, "bf16").global_bytes_per_token == 6880
    assert build_layout(cfg, "fp8").pool("swa").per_sequence_bytes == 44 * 128 * 584
