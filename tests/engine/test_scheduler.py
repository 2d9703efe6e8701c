"""Continuous batching, preemption, speculation and aborts through the real engine (tiny model)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import RequestError
from engine.weights import load_model
from ipc.codec import InvalidField, check
from ipc.messages import SamplingParams
from reference_driver import generate

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.float32, progress=False)


def _prompts(n: int, seed: int = 0, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [torch.randint(2, 500, (rng.randint(1, max_len),), generator=torch.Generator().manual_seed(seed * 1000 + i)).tolist()
            for i in range(n)]


def _engine(model, **kw) -> Engine:
    args = dict(max_num_seqs=8, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20, block_size=16)
    args.update(kw)
    return Engine(model, EngineConfig(**args))


def _run(engine: Engine, prompts, params=GREEDY, seed: int = 1, on_step=None) -> dict[int, list[int]]:
    """Requests arrive at random steps; returns request id → output tokens."""
    rng = random.Random(seed)
    out: dict[int, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_work:
        while pending and (rng.random() < 0.4 or not engine.has_work):
            i, p = pending.pop(0)
            engine.add_request(i, p, params if isinstance(params, SamplingParams) else params[i])
        for d in engine.step().deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)
        if on_step:
            on_step(engine)
    return out


def _alone(model, prompts, params=GREEDY):
    return [g.token_ids for g in generate(model, prompts, params)]


def _assert_clean(engine: Engine) -> None:
    assert engine.cache.manager.full.num_used == 0
    assert engine.cache.manager.sliding.num_used == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_requests_arriving_at_random_steps_equal_each_alone(model):
    prompts = _prompts(64)
    engine = _engine(model)
    out = _run(engine, prompts)
    assert [out[i] for i in range(64)] == _alone(model, prompts)
    _assert_clean(engine)


def test_preemption_under_a_small_pool_keeps_outputs(model):
    prompts = _prompts(16, seed=2)
    engine = _engine(model, num_kv_blocks=7)
    out = _run(engine, prompts)
    assert engine.stats.num_preemptions > 0
    assert [out[i] for i in range(16)] == _alone(model, prompts)
    _assert_clean(engine)


def test_speculation_is_lossless_under_greedy(model):
    prompts = _prompts(12, seed=3)
    engine = _engine(model, speculative_tokens=3, adaptive_speculation=False)  # verify all 3 every step
    out = _run(engine, prompts)
    assert [out[i] for i in range(12)] == _alone(model, prompts)
    assert engine.stats.spec_draft_tokens > 0
    _assert_clean(engine)


def _forced_drafts(kind: str, truth: dict[int, list[int]]):
    """A draft override: every draft wrong, or the true continuation (as many as proposed)."""
    def override(req, accepted_now, proposed):
        if kind == "wrong":
            return [(t + 1) % 500 for t in proposed]
        done = req.num_output_tokens + len(accepted_now)
        return truth[req.request_id][done : done + len(proposed)] or proposed

    return override


@pytest.mark.parametrize("drafts", ["wrong", "right"])
def test_forced_drafts_give_the_same_output(model, drafts):
    prompts = _prompts(6, seed=4)
    truth = {i: t for i, t in enumerate(_alone(model, prompts))}
    engine = _engine(model, speculative_tokens=3, adaptive_speculation=False)
    engine.runner.draft_override = _forced_drafts(drafts, truth)
    out = _run(engine, prompts)
    assert out == truth
    accepted = engine.stats.spec_accepted_per_position
    if drafts == "wrong":
        assert sum(accepted) == 0
    else:
        assert accepted[0] > 0 and accepted[2] > 0
    _assert_clean(engine)


@pytest.mark.parametrize("drafts", ["wrong", "right"])
def test_adaptive_speculation_follows_acceptance(model, drafts):
    """Always-wrong drafts turn verification down to the periodic probes; always-right ones keep
    all 3 drafts verified. Output is the greedy output either way."""
    prompts = _prompts(4, seed=6, max_len=20)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    truth = {i: t for i, t in enumerate(_alone(model, prompts, params))}
    engine = _engine(model, speculative_tokens=3)
    engine.runner.draft_override = _forced_drafts(drafts, truth)
    # Step times as a GPU would show them (verification nearly free, drafts cost a little), so
    # the choice depends on acceptance only, not on this machine's timing noise.
    control = engine.spec_control
    measured = control.observe_step_time
    control.observe_step_time = lambda num_seqs, depth, seconds: measured(num_seqs, depth, 0.010 * (1 + 0.05 * depth))
    assert _run(engine, prompts, params) == truth
    drafts_per_verify = engine.stats.spec_draft_tokens / max(1, engine.stats.spec_drafts)
    if drafts == "wrong":
        decode_steps = engine.stats.steps
        assert engine.stats.spec_drafts < 0.3 * decode_steps * len(prompts)  # mostly plain decode
    else:
        assert drafts_per_verify > 2.5 and engine.stats.spec_accepted_per_position[2] > 0
    _assert_clean(engine)


def test_abort_in_every_state_frees_everything(model):
    engine = _engine(model, speculative_tokens=3, max_num_seqs=2, max_num_batched_tokens=16)
    prompts = _prompts(5, seed=5, max_len=40)
    for i, p in enumerate(prompts):
        engine.add_request(i, p + [7] * 30, GREEDY)
    engine.step()  # request 0 prefilling (chunked), 1 waiting for budget, others waiting for a slot
    states = {rid: (r.status.value, r.num_computed_tokens) for rid, r in engine.scheduler.requests.items()}
    assert engine.abort(3) is not None  # waiting
    assert engine.abort(0) is not None  # mid-prefill
    while not any(r.draft_token_ids for r in engine.scheduler.running):
        engine.step()
    verifying = next(r for r in engine.scheduler.running if r.draft_token_ids)
    assert engine.abort(verifying.request_id) is not None  # decoding with drafts pending verification
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    assert states
    _assert_clean(engine)
    assert engine.abort(12345) is None


def test_same_seed_same_tokens_whatever_the_batch(model):
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=123, ignore_eos=True)
    prompt = _prompts(1, seed=6)[0]
    alone = _run(_engine(model), [prompt], sampled)[0]
    others = _prompts(7, seed=7)
    params = [sampled] + [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)] * 7
    crowded = _run(_engine(model), [prompt] + others, params, seed=9)[0]
    assert alone == crowded


def test_bad_sampling_parameters_are_refused():
    for kwargs, name in [({"temperature": -1.0}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
                         ({"min_p": 2.0}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
                         ({"presence_penalty": 3.0}, "presence_penalty"), ({"logprobs": 50}, "logprobs")]:
        with pytest.raises(InvalidField, match=name) as refused:
            check(SamplingParams(**kwargs))
        assert refused.value.field == name


def test_context_overflow_is_refused_up_front(model):
    engine = _engine(model, max_model_len=64)
    with pytest.raises(RequestError, match=r"60 tokens.*max_tokens \(10\).*64 tokens"):
        engine.add_request(1, [3] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request(2, [3, 10**6], GREEDY)
    assert not engine.has_work
    # The edge validator's boundaries and wording (tests/ipc/test_prompt_checks.py has the others'):
    # n + max_tokens == the context fits, one more does not; ids in [0, V); an empty prompt.
    vocab = model.cfg.vocab_size
    for rid, (prompt, max_tokens, refusal) in enumerate([
            ([3] * 55, 10, "prompt (55 tokens) plus max_tokens (10) exceeds the model's context length (64 tokens)"),
            ([3, vocab], 4, f"token id {vocab} is outside the vocabulary [0, {vocab})"),
            ([3, -1], 4, f"token id -1 is outside the vocabulary [0, {vocab})"),
            ([], 4, "the prompt is empty")], start=10):
        with pytest.raises(RequestError) as refused:
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
        assert str(refused.value) == refusal
    assert not engine.has_work
    engine.add_request(20, [3] * 54, SamplingParams(max_tokens=10))
    engine.add_request(21, [vocab - 1], SamplingParams(max_tokens=63))
    assert {r.request_id for r in engine.scheduler.waiting} == {20, 21}
    engine.abort(20)
    engine.abort(21)


def test_non_finite_logits_fail_only_that_request(model):
    engine = _engine(model)
    prompts = _prompts(3, seed=8)
    original = engine.runner._sample

    def poisoned(pending, logits, *rest):
        for p in pending:
            if p.sched.request.request_id == 1:
                logits[p.logit_rows] = float("nan")
        return original(pending, logits, *rest)

    engine.runner._sample = poisoned
    finals = {}
    for i, p in enumerate(prompts):
        engine.add_request(i, p, GREEDY)
    while engine.has_work:
        for d in engine.step().finished:
            finals[d.request_id] = (d.reason, d.error)
    assert finals[1] == ("error", "non-finite logits")
    assert finals[0][0] == finals[2][0] == "length"
    _assert_clean(engine)
