"""Prompt scoring in the engine (SamplingParams.prompt_logprobs): requests arriving at random
steps, prefills split into chunks, preemption under a small KV pool and speculation all leave
each request's prompt scores equal to a whole-prompt forward's, sent once with its first delta."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.weights import load_model
from ipc.messages import SamplingParams
from train.evaluate import ringserve_logits

TOP = 3


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.float32, progress=False)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, 500) for _ in range(rng.randint(1, 50))] for _ in range(n)]


def _expected(model, prompt: list[int]) -> tuple[torch.Tensor, list[int], list[list[int]]]:
    """(logprobs [P-1], ranks, top-TOP ids) of prompt tokens 1 … P−1 from one full forward."""
    logp = torch.log_softmax(ringserve_logits(model, torch.tensor(prompt)), dim=-1)[:-1]  # [P-1, V]
    target = torch.tensor(prompt[1:], dtype=torch.long)
    chosen = logp.gather(1, target[:, None])  # [P-1, 1]
    ranks = ((logp > chosen).sum(-1) + 1).tolist()
    return chosen.squeeze(1), ranks, logp.topk(TOP, dim=-1).indices.tolist()


@pytest.mark.parametrize("engine_args", [dict(), dict(num_kv_blocks=7), dict(speculative_tokens=2)],
                         ids=["chunked", "preempting", "speculating"])
def test_prompt_scores_equal_a_whole_prompt_forward(model, engine_args):
    prompts = _prompts(12)
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20,
                                        block_size=16, **engine_args))
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    rng, pending, got, deltas = random.Random(2), list(enumerate(prompts)), {}, {}
    while pending or engine.has_work:
        while pending and (rng.random() < 0.4 or not engine.has_work):
            i, p = pending.pop(0)
            engine.add_request(i, p, params)
        for d in engine.step().deltas:
            deltas[d.request_id] = deltas.get(d.request_id, 0) + 1
            if d.prompt is not None:
                assert d.request_id not in got and deltas[d.request_id] == 1  # once, with the first delta
                got[d.request_id] = d.prompt
    if "num_kv_blocks" in engine_args:
        assert engine.stats.num_preemptions > 0
    assert sorted(got) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        want, ranks, top = _expected(model, prompt)
        scores = got[i]
        torch.testing.assert_close(torch.tensor(scores.logprobs), want, rtol=0, atol=1e-4)
        assert scores.ranks == ranks
        assert [[t for t, _ in row] for row in scores.top_logprobs] == top


def test_requests_without_prompt_logprobs_get_none(model):
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20,
                                        block_size=16))
    engine.add_request(0, _prompts(1)[0], SamplingParams(max_tokens=2, ignore_eos=True))
    seen = []
    while engine.has_work:
        seen += [d.prompt for d in engine.step().deltas]
    assert seen and all(p is None for p in seen)
