"""Async scheduling (--async-scheduling): step t + 1 is scheduled and launched before step t is
read back, its sampled tokens standing in as placeholders. The reference is the synchronous
engine on the same requests: every request's tokens, logprobs and finish reason must be the
same, through the static (fused) decode path and the per-sequence one, while nothing leaks and
every step still makes exactly one host read — made by `finish`, never by `launch`."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
import torch
from tokenizers import Tokenizer

from engine.batch import RequestStepOutput, StepOutput
from engine.config import EngineConfig
from engine.engine import Engine
from engine.weights import load_model
from ipc.loop import new_event_loop
from ipc.messages import Finished, SamplingParams
from server.builtin import trained_model_dir
from server.engine_client import EngineClient
from tests.host_syncs import count_host_reads


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("tiny-topk2", index_topk=2)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype=torch.float32, progress=False)


def _engine(model, async_scheduling: bool, **kw) -> Engine:
    base = dict(max_num_seqs=4, max_num_batched_tokens=24, kv_cache_memory_bytes=4 << 20, block_size=16,
                cpu_matmul_precision="fp32")
    base.update(kw)
    return Engine(model, EngineConfig(async_scheduling=async_scheduling, **base))


def _requests(model) -> list[tuple[list[int], SamplingParams]]:
    """Greedy, seeded sampling, logprobs, penalties, stop tokens that fire (a request then ends
    while its next step is in flight), max_tokens 1 and 2, prompts longer than a step's token
    budget (chunked prefill), more requests than sequence slots."""
    rng = random.Random(3)
    prompt = lambda n: [rng.randrange(3, 400) for _ in range(n)]  # noqa: E731
    first = (prompt(5), SamplingParams(max_tokens=9, ignore_eos=True))
    greedy = _drive(_engine(model, False), [first])[0][0]
    return [
        first,
        (prompt(40), SamplingParams(max_tokens=7, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)),
        (prompt(3), SamplingParams(max_tokens=1, ignore_eos=True)),
        (prompt(17), SamplingParams(max_tokens=6, logprobs=2, ignore_eos=True)),
        (prompt(8), SamplingParams(max_tokens=8, presence_penalty=-2.0, frequency_penalty=-1.0, ignore_eos=True)),
        (prompt(9), SamplingParams(max_tokens=8, temperature=1.0, seed=4, presence_penalty=-2.0, ignore_eos=True)),
        (prompt(2), SamplingParams(max_tokens=2, ignore_eos=True)),
        (first[0], SamplingParams(max_tokens=9, stop_token_ids=[greedy[3]])),
        (prompt(30), SamplingParams(max_tokens=12, temperature=1.1, seed=9)),
    ]


def _drive(engine: Engine, requests, abort_at: dict[int, int] | None = None, arrive_at: dict[int, int] | None = None):
    """Run every request to its end; request i arrives before call arrive_at[i] (default 0) and is
    aborted before call abort_at[i]. Returns (per request: tokens, logprobs, finish reason)."""
    abort_at, arrive_at = abort_at or {}, arrive_at or {}
    tokens = {i: [] for i in range(len(requests))}
    logprobs = {i: [] for i in range(len(requests))}
    reasons: dict[int, str] = {}
    calls = 0
    while len(reasons) < len(requests):
        for i, (ids, params) in enumerate(requests):
            if arrive_at.get(i, 0) == calls:
                engine.add_request(i, ids, params)
            if abort_at.get(i) == calls:
                done = engine.abort(i)
                if done is not None:
                    reasons[i] = done.reason
        out = engine.step()
        for d in out.deltas:
            tokens[d.request_id] += d.token_ids
            logprobs[d.request_id] += d.logprobs or []
        for f in out.finished:
            assert f.request_id not in reasons, f"request {f.request_id} finished twice"
            reasons[f.request_id] = f.reason
        calls += 1
        assert calls < 500, "the engine stopped making progress"
    assert not engine.has_work
    return [(tokens[i], logprobs[i], reasons[i]) for i in range(len(requests))]


def _assert_nothing_held(engine: Engine) -> None:
    assert not engine.scheduler.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine._in_flight is None
    assert engine.cache.manager.full.num_used == 0, "a KV block was not returned"


@pytest.mark.parametrize("static", [True, False], ids=["static", "per-sequence"])
def test_async_steps_give_the_synchronous_engines_tokens(model, static):
    requests = _requests(model)
    arrive = {6: 3, 7: 4, 8: 9}  # some arrive while others decode
    want = _drive(_engine(model, False, static_decode=static), requests, arrive_at=arrive)
    engine = _engine(model, True, static_decode=static)
    assert engine.async_scheduling
    got = _drive(engine, requests, arrive_at=arrive)
    for i, ((t, lp, r), (t2, lp2, r2)) in enumerate(zip(want, got)):
        assert (t2, r2) == (t, r), f"request {i}"
        assert lp2 == pytest.approx(lp, abs=1e-5), f"request {i}"
    assert [len(t) for t, _, _ in got][:7] == [9, 7, 1, 6, 8, 8, 2]
    assert got[7][2] == "stop" and len(got[7][0]) <= 4
    _assert_nothing_held(engine)
    if static:
        assert engine.static.num_runs > 0  # decode steps took the static path with placeholders


TEXTS = ["The function returns a new list of the items in the",
         "To open a file for reading, call the built-in function",
         "The module provides a way of using operating system dependent",
         "If the argument is omitted, the default value of the"]


@pytest.fixture(scope="module")
def trained():
    """The shipped trained built-in model: its MTP drafts are often right under greedy decoding."""
    path = trained_model_dir()
    if path is None:
        pytest.skip("no trained built-in model in server/builtin_model/ (ringserve train-builtin makes it)")
    return load_model(path, dtype=torch.float32, progress=False)


@pytest.mark.parametrize("spec", [0, 3], ids=["plain", "mtp"])
def test_aborts_and_preemption_under_async_steps(request, spec):
    """A pool so small that requests are preempted, and aborts of requests whose step is in
    flight: every request ends once, the survivors' tokens equal the synchronous engine's, and
    every block comes back. With MTP on the trained built-in model (greedy: speculation is
    lossless, so the tokens cannot depend on when preemption cleared a request's drafts) the
    drafts are often right, and steps after a verification are launched shifted."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    if spec:
        model = request.getfixturevalue("trained")
        tok = Tokenizer.from_file(str(trained_model_dir() / "tokenizer.json"))
        requests = [(tok.encode(text).ids, params) for text in TEXTS]
    else:
        model = request.getfixturevalue("model")
        requests = [(list(range(3 + i, 30 + i)), params) for i in range(4)]
    small = dict(num_kv_blocks=5 if spec else 9, enable_prefix_caching=False, speculative_tokens=spec,
                 adaptive_speculation=False)
    abort = {1: 6, 3: 12}
    want = _drive(_engine(model, False, **small), requests, abort_at=abort)
    engine = _engine(model, True, **small)
    shifted = []
    launch = engine.runner.launch
    engine.runner.launch = lambda batch, *a, **kw: (shifted.append(any(s.shift for s in batch.scheduled)),
                                                    launch(batch, *a, **kw))[1]
    got = _drive(engine, requests, abort_at=abort)
    assert engine.scheduler.num_preemptions > 0
    if spec:  # steps after a verification ran ahead, shifted; many of the drafts were right
        assert sum(shifted) >= 3 and engine.stats.spec_accepted_per_position[0] >= 5, (shifted, engine.stats)
    assert [r for _, _, r in got] == ["length", "abort", "length", "abort"]
    assert got[0][0] == want[0][0] and got[2][0] == want[2][0]
    _assert_nothing_held(engine)


@pytest.mark.parametrize("spec", [0, 3], ids=["plain", "mtp"])
def test_an_async_step_waits_only_in_finish(model, spec):
    """Every engine step makes exactly one host read — the wait for the previous step's results —
    and launching a decode step makes none (so on a GPU the host runs ahead of the device);
    with MTP speculation too, where a step verifies drafts the step in flight proposed."""
    engine = _engine(model, True, speculative_tokens=spec, adaptive_speculation=False)
    for i in range(3):
        engine.add_request(i, [7 + i, 40, 3], SamplingParams(max_tokens=6 + 4 * spec, temperature=0.7, seed=i,
                                                             ignore_eos=True))
    runner, launches, per_step = engine.runner, [], []
    launch = runner.launch
    with count_host_reads() as calls:
        def counted(batch, *args, **kwargs):
            before = len(calls)
            out = launch(batch, *args, **kwargs)
            launches.append((batch.uniform_decode, calls[before:]))
            return out

        runner.launch = counted
        while engine.has_work:
            before, reads = len(calls), runner.num_host_reads
            engine.step()
            per_step.append((calls[before:], runner.num_host_reads - reads))
    decode_launches = [c for q, c in launches if q == 1 + spec]
    assert len(decode_launches) >= 4 and all(not c for c in decode_launches), decode_launches
    # the first call only launches; every later one waits once, in PendingRead.wait
    assert per_step[0] == ([], 1)
    if not spec:
        assert all(len(c) == 1 and c[0].startswith("PendingRead.wait") for c, _ in per_step[1:]), per_step
        return
    # With drafts, a request whose step in flight may sample its last token is not run ahead
    # (nor, after a call that only waited, the next, which only launches): near the ends some
    # calls launch nothing; none reads more than once.
    assert all(len(c) <= 1 and all(x.startswith("PendingRead.wait") for x in c) for c, _ in per_step), per_step
    assert sum(len(c) == 1 and n == 1 for c, n in per_step) >= 4, per_step  # waited for t, launched t + 1


def _spec_requests() -> list[tuple[list[int], SamplingParams]]:
    """Requests whose MTP drafts are often accepted on a random-weight model: at a high
    temperature the target's and the draft's distributions are both near uniform, so rejection
    sampling accepts most drafts — every acceptance count occurs, so later steps' positions
    shift by each. Beside them: greedy ones (drafts mostly rejected), logprobs, a stop token."""
    rng = random.Random(5)
    prompt = lambda n: [rng.randrange(3, 400) for _ in range(n)]  # noqa: E731
    hot = lambda seed, n: SamplingParams(max_tokens=n, temperature=8.0, seed=seed, ignore_eos=True)  # noqa: E731
    return [
        (prompt(6), hot(1, 17)),
        (prompt(21), hot(2, 11)),
        (prompt(3), SamplingParams(max_tokens=9, ignore_eos=True)),
        (prompt(9), SamplingParams(max_tokens=8, temperature=8.0, seed=3, logprobs=1, ignore_eos=True)),
        (prompt(2), hot(4, 2)),
        (prompt(12), SamplingParams(max_tokens=14, temperature=0.8, top_k=5, seed=6, ignore_eos=True)),
        (prompt(5), hot(7, 13)),
    ]


@pytest.mark.parametrize("adaptive", [False, True], ids=["k3", "adaptive"])
def test_async_steps_with_speculation_give_the_synchronous_engines_tokens(model, adaptive):
    """MTP speculation under async scheduling: step t + 1 verifies the drafts step t proposes
    (placeholders) at positions shifted on the device by t's acceptance count. Tokens,
    logprobs and finish reasons equal the synchronous engine's; drafts were accepted at every
    depth; the steps ran ahead (launched before their predecessor was read)."""
    requests = _spec_requests()
    if adaptive:  # the draft count follows acceptance, which async steps see a step later: greedy
        requests = [(ids, msgspec.structs.replace(p, temperature=0.0)) for ids, p in requests]  # is lossless anyway
    arrive = {4: 5, 5: 8, 6: 9}
    spec = dict(speculative_tokens=3, adaptive_speculation=adaptive)
    sync = _engine(model, False, **spec)
    want = _drive(sync, requests, arrive_at=arrive)
    engine = _engine(model, True, **spec)
    assert engine.async_scheduling
    shifted = []
    launch = engine.runner.launch

    def counted(batch, *args, **kwargs):
        shifted.append(sum(s.shift > 0 for s in batch.scheduled))
        return launch(batch, *args, **kwargs)

    engine.runner.launch = counted
    got = _drive(engine, requests, arrive_at=arrive)
    for i, ((t, lp, r), (t2, lp2, r2)) in enumerate(zip(want, got)):
        assert (t2, r2) == (t, r), f"request {i}"
        assert lp2 == pytest.approx(lp, abs=1e-5), f"request {i}"
    assert [len(t) for t, _, _ in got] == [17, 11, 9, 8, 2, 14, 13]
    if not adaptive:
        assert min(engine.stats.spec_accepted_per_position) > 0, engine.stats
    assert sum(shifted) > 5, shifted  # steps launched with positions known on the device only
    if not adaptive:
        assert engine.stats.spec_accepted_per_position == sync.stats.spec_accepted_per_position
    _assert_nothing_held(engine)


def test_a_step_that_verifies_no_drafts_lets_arrivals_in_ahead(model):
    """With speculation on but no drafts proposed (as adaptive speculation does at large
    batches), nothing shifts: a request arriving mid-decode is admitted into a step launched
    ahead, as without speculation, and the tokens equal the synchronous engine's."""
    requests = _requests(model)[:4]
    arrive = {2: 3, 3: 5}
    spec = dict(speculative_tokens=3, adaptive_speculation=False)
    sync = _engine(model, False, **spec)
    sync.draft_wish = lambda batch: 0
    want = _drive(sync, requests, arrive_at=arrive)
    engine = _engine(model, True, **spec)
    engine.draft_wish = lambda batch: 0
    admitted_ahead = []
    launch = engine.runner.launch

    def counted(batch, *args, ahead=None, **kwargs):
        if ahead is not None:
            admitted_ahead.extend(s.request.request_id for s in batch.scheduled if s.start == 0)
        return launch(batch, *args, ahead=ahead, **kwargs)

    engine.runner.launch = counted
    got = _drive(engine, requests, arrive_at=arrive)
    assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in want]
    assert set(admitted_ahead) >= {2, 3}, admitted_ahead


def test_a_shifted_step_is_scheduled_and_updated_from_the_true_positions(model):
    """The scheduler alone, with hand-made step outputs: a verify step t in flight (3 drafts)
    is followed by step t + 1 at the earliest position after it, shifted by up to 3, its
    blocks covering the latest end; each update then moves the request to its true position."""
    engine = _engine(model, False, speculative_tokens=3, adaptive_speculation=False)
    sched, prompt = engine.scheduler, list(range(10, 30))  # 20 tokens
    req = engine.add_request(0, prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    prefill = sched.schedule()
    sched.update(prefill, StepOutput({0: RequestStepOutput([5], drafts=[6, 7, 8])}))
    verify = sched.schedule()  # step t: the last token and 3 drafts at positions 20..23
    (t,) = verify.scheduled
    assert (t.start, t.num_tokens, t.num_draft, t.shift) == (20, 4, 3, 0)
    ahead = sched.schedule(ahead=verify, ahead_drafts={0: 3})  # step t + 1 while t is in flight
    (u,) = ahead.scheduled
    assert (u.start, u.num_tokens, u.num_draft, u.num_placeholder, u.shift) == (21, 4, 3, 4, 3)
    assert u.token_ids() == [0, 0, 0, 0] and u.max_end == 28
    assert len(req.seq.table.full) * engine.cache.layout.block_size >= u.max_end
    # t accepts 2 of its 3 drafts: 3 new tokens, position 23 (the bonus token's) comes next
    sched.update(verify, StepOutput({0: RequestStepOutput([6, 7, 9], drafts=[1, 2, 3])}))
    assert req.num_computed_tokens == 23 and req.token_ids[20:] == [5, 6, 7, 9]
    # t + 1 ran at 23..26 and accepted none of [1, 2, 3]
    sched.update(ahead, StepOutput({0: RequestStepOutput([4], drafts=[8, 8, 8])}))
    assert req.num_computed_tokens == 24 and req.token_ids[20:] == [5, 6, 7, 9, 4]
    assert req.draft_token_ids == [8, 8, 8]
    engine.abort(0)
    _assert_nothing_held(engine)


def test_async_scheduling_is_off_where_it_cannot_apply(model):
    assert _engine(model, True, speculative_tokens=1).async_scheduling
    assert not _engine(model, True, speculative_tokens=1, static_decode=False).async_scheduling
    assert not _engine(model, False).async_scheduling


@pytest.mark.parametrize("spec", [0, 3], ids=["plain", "mtp"])
def test_a_server_worker_with_async_scheduling(model_dir, model, spec):
    """Through the real worker process: the same tokens as an in-process synchronous engine
    (greedy, and seeded sampling hot enough that MTP drafts are accepted)."""
    prompts = [[5, 9, 17], [100, 3, 3, 8, 41], [250]]
    params = SamplingParams(max_tokens=12, temperature=8.0 if spec else 0.0, seed=2, ignore_eos=True)
    spec_kw = dict(speculative_tokens=spec, adaptive_speculation=False)
    sync = _engine(model, False, **spec_kw)
    want = _drive(sync, [(p, params) for p in prompts])

    async def main():
        client = EngineClient(model_dir, EngineConfig(max_num_seqs=4, max_num_batched_tokens=24,
                                                      kv_cache_memory_bytes=4 << 20, block_size=16,
                                                      cpu_matmul_precision="fp32", async_scheduling=True,
                                                      **spec_kw),
                              threads_per_worker=1)
        await client.start()
        try:
            async def one(ids):
                tokens = []
                async for item in client.generate(ids, params):
                    if isinstance(item, Finished):
                        assert item.reason == "length", item
                    else:
                        tokens += item.token_ids
                return tokens

            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=120)
        finally:
            await client.shutdown()

    loop = new_event_loop()
    try:
        got = loop.run_until_complete(main())
    finally:
        loop.close()
    assert got == [t for t, _, _ in want]
