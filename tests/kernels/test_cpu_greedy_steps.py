"""Several greedy decode steps in one compiled CPU call (`--cpu-decode-steps`,
kernels/cpu_step.greedy_steps) against the same engine running one step per call (whose
compiled step tests/kernels/test_cpu_step.py checks against the op path): the same tokens, the
same stops, nothing left allocated, fewer engine steps; and the scheduler's lookahead only for
the requests a call can decode alone (plain greedy, within max_tokens and the context)."""
from __future__ import annotations

import dataclasses

import pytest

import engine.engine as engine_module
from engine.engine import steps_within_budget
from ipc.messages import SamplingParams
from kernels.cpu_step_plan import StepProgram
from tests.kernels.test_cpu_step import _engine, _prompts
from tests.kernels.test_cpu_step_engine import models  # noqa: F401  (the fixture: bf16 and FP8/FP4 tiny models)


def _run(engine, prompts, params: list[SamplingParams]) -> tuple[dict[int, list[int]], dict[int, str]]:
    """(request id → tokens, request id → finish reason), all requests added at once."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(i, p, sp)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    reasons: dict[int, str] = {}
    while engine.has_work:
        step = engine.step()
        for d in step.deltas:
            out[d.request_id].extend(d.token_ids)
        for f in step.finished:
            reasons[f.request_id] = str(f.reason)
    return out, reasons


def _both(model, prompts, params, steps: int):
    """The run at one step per call and at `steps`, with each engine's step count and whether
    its pools came back whole."""
    runs = []
    for k in (1, steps):
        engine = _engine(model, len(prompts), cpu_decode_steps=k)
        manager = engine.cache.manager
        free = (manager.full.num_free, manager.sliding.num_free)
        tokens, reasons = _run(engine, prompts, params)
        assert manager.full.num_used == 0 and manager.sliding.num_used == 0
        assert (manager.full.num_free, manager.sliding.num_free) == free
        runs.append((tokens, reasons, engine.stats.steps, engine))
    return runs


@pytest.mark.parametrize("name", ["bf16", "fp8-fp4"])
@pytest.mark.parametrize("seqs,steps", [(1, 4), (5, 3), (9, 8)])
def test_greedy_steps_equal_one_step_per_call(models, name, seqs, steps):
    """Requests of different lengths (max_tokens 1 .. 40, so the batch's lookahead shrinks as
    they near their ends) over 16-position blocks (calls cross block and compression
    boundaries): the tokens of one step per call, in fewer engine steps."""
    model = models[name]
    prompts = _prompts(seqs, model.cfg.vocab_size, seqs)
    params = [SamplingParams(max_tokens=[40, 1, 7, 23, 2, 31, 5, 40, 13][i], ignore_eos=True) for i in range(seqs)]
    (one, _, one_steps, _), (many, _, many_steps, engine) = _both(model, prompts, params, steps)
    assert many == one
    assert [len(t) for t in many.values()] == [p.max_tokens for p in params]
    assert many_steps < one_steps
    program = next(p for _, p in engine.static.fused._programs.values() if p is not None)
    assert program.entry is not None                       # the compiled entry point ran the calls


def test_a_stop_id_ends_the_call_where_the_single_steps_end(models, monkeypatch):
    """A request's stop id (and EOS) met mid-call: the call stops after that step, the request
    ends on the id as with one step per call, and the others go on with the same tokens."""
    model = models["fp8-fp4"]
    prompts = _prompts(4, model.cfg.vocab_size, 3)
    free_run = [SamplingParams(max_tokens=30, ignore_eos=True)] * 4
    reference = _both(model, prompts, free_run, 1)[0][0]
    stop = reference[1][10]                                 # a token request 1 meets on its own, mid-call
    eos = reference[2][7]
    monkeypatch.setattr(model, "cfg", dataclasses.replace(model.cfg, eos_token_ids=(eos,)))
    calls = []                                              # (steps asked, tokens [n, done]) per call
    run_greedy = StepProgram.run_greedy

    def recorded(program, steps, live, stops):
        tokens, finite = run_greedy(program, steps, live, stops)
        calls.append((steps, tokens, stops))
        return tokens, finite

    monkeypatch.setattr(StepProgram, "run_greedy", recorded)
    params = [SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop,)),
              SamplingParams(max_tokens=30),                # ends at its EOS
              SamplingParams(max_tokens=30, ignore_eos=True)]
    (one, one_reasons, _, _), (many, many_reasons, _, _) = _both(model, prompts, params, 4)
    assert many == one and many_reasons == one_reasons
    assert many[1] == reference[1][: reference[1].index(stop) + 1]
    assert many[2] == reference[2][: reference[2].index(eos) + 1]
    assert many[0] == reference[0] and many[3] == reference[3]
    # each call stopped after the first step in which a row met one of its ids, and only then
    ended = [(steps, tokens.shape[1], bool((tokens[:, :, None] == stops[:, None, :]).any(axis=2)[:, -1].any()))
             for steps, tokens, stops in calls]
    assert all((done < steps) <= met for steps, done, met in ended)
    assert any(met and done < steps for steps, done, met in ended)          # (exercised)
    for _, tokens, stops in calls:
        met = (tokens[:, :, None] == stops[:, None, :]).any(axis=2)
        assert not met[:, :-1].any()


def test_a_sampled_request_keeps_its_batch_at_one_step_per_call(models):
    """Only plain greedy requests get a lookahead: with a seeded sampled request (and one
    asking for logprobs) in the batch every call runs one step, and all tokens equal the
    one-step run's."""
    model = models["bf16"]
    prompts = _prompts(3, model.cfg.vocab_size, 5)
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7),
              SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)]
    (one, _, one_steps, _), (many, _, many_steps, _) = _both(model, prompts, params, 4)
    assert many == one and many_steps == one_steps


def test_lookahead_only_for_plain_greedy_decodes(models):
    """The scheduler's lookahead: up to decode_steps − 1 positions for a plain greedy decode,
    within its max_tokens (the edge keeps prompt + max_tokens within the context); none for a
    prefill, a sampled request, penalties, logprobs."""
    model = models["bf16"]
    engine = _engine(model, 6, cpu_decode_steps=4)
    prompts = _prompts(6, model.cfg.vocab_size, 2)
    params = [SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=3, ignore_eos=True),                     # two tokens after the first
              SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.5),
              SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=14, ignore_eos=True)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(i, p, sp)
    first = engine.scheduler.schedule()                      # the prefills
    assert [s.lookahead for s in first.scheduled] == [0] * 6
    engine.scheduler.update(first, engine.runner.execute(first, 0))
    decode = engine.scheduler.schedule()
    assert [s.lookahead for s in decode.scheduled] == [3, 1, 0, 0, 0, 3]
    for s in decode.scheduled:                                # its blocks cover the lookahead
        table, block = s.request.seq.table, engine.cache.layout.block_size
        assert len(table.full) * block >= s.max_end
    engine.scheduler.update(decode, engine.runner.execute(decode, 0))


def test_calls_run_as_many_steps_as_fit_the_budget(models, monkeypatch):
    """steps_within_budget: four steps of ≤ 5 ms fit a call, two of 10 ms, one of more; the
    engine paces its scheduler by the last decode step's time per token, so with a budget no
    step fits it runs one step per call after its first decode, with a budget every step fits
    four, and the tokens are the one-step run's either way."""
    assert [steps_within_budget(s, 4) for s in (0.0005, 0.005, 0.0066, 0.01, 0.011, 0.05)] == [4, 4, 3, 2, 1, 1]
    assert steps_within_budget(0.001, 1) == 1 and steps_within_budget(0.0, 8) == 8
    model = models["bf16"]
    prompts = _prompts(3, model.cfg.vocab_size, 4)
    params = [SamplingParams(max_tokens=14, ignore_eos=True)] * 3
    reference, _, one_steps, _ = _both(model, prompts, params, 1)[0]
    for budget, per_call, steps in ((1e-6, 1, one_steps - 3), (60.0, 4, 5)):
        monkeypatch.setattr(engine_module, "CALL_BUDGET_S", budget)
        engine = _engine(model, 3, cpu_decode_steps=4)
        tokens, _ = _run(engine, prompts, params)
        assert tokens == reference
        assert engine.scheduler.steps_per_call == per_call
        assert engine.stats.steps == steps     # the prefill, then 13 tokens: one call of 4 first, then 1s or 4s
