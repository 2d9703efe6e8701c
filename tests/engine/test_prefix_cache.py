"""Prefix caching: the allocator's books under random use, and through the real engine (tiny
model: window 8, compress ratios 4 and 8, blocks of 16) cached runs equal cold ones, bounded
replay never rewrites shared blocks, eviction/abort/preemption leak nothing, salts isolate."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockAllocator, block_hash
from engine.config import EngineConfig
from engine.engine import Engine
from engine.weights import load_model
from ipc.messages import SamplingParams
from reference_driver import generate

B = 16  # block size of every engine here
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0)


# ---- allocator: content addressing against a model of the block contents ----------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "register", "hit"]), st.integers(0, 1 << 16)),
                max_size=80))
def test_cached_blocks_are_never_handed_out_while_held_nor_found_after_reuse(ops):
    """The test keeps what each block holds (a fresh value per allocation). A referenced block is
    never allocated again, a hash always finds a block holding what it held when registered, and
    the counts add up."""
    a = BlockAllocator(9)
    content: dict[int, int] = {}  # block → value written at its allocation
    named: dict[bytes, int] = {}  # hash → the value its block held at registration
    held: list[int] = []  # one entry per reference the test holds
    fresh = iter(range(1 << 30))
    for op, r in ops:
        if op == "alloc":
            ids = a.allocate(1 + r % 3)
            if ids is None:
                assert a.num_free < 1 + r % 3
                continue
            assert not set(ids) & set(held), "a referenced block was handed out"
            for i in ids:
                content[i] = next(fresh)
            held += ids
        elif op == "free" and held:
            a.free([held.pop(r % len(held))])
        elif op == "register" and held:
            i = held[r % len(held)]
            h = r.to_bytes(4, "little")
            if a.register(i, h):
                named[h] = content[i]
        elif op == "hit" and named:
            h = sorted(named)[r % len(named)]
            i = a.lookup(h)
            if i is None:
                continue  # evicted: fine, as long as it was not found with other content
            assert content[i] == named[h], "a hash found a block whose content changed"
            a.touch([i])
            held.append(i)
        for h, i in a.cached.items():
            assert content[i] == named[h]
        assert a.num_used == len(set(held))
        assert sum(a.refcount) == len(held)
        assert a.num_free + a.num_used == a.num_blocks - 1


def test_eviction_takes_the_least_recently_freed_and_forgets_its_hash():
    a = BlockAllocator(4)
    evicted = []
    a.on_evict = evicted.append
    x, y, z = a.allocate(3)
    for i, h in ((x, b"x"), (y, b"y"), (z, b"z")):
        assert a.register(i, h)
    a.free([y, x])  # y is older in the queue than x
    a.touch([a.lookup(b"x")])  # x revived: no longer evictable
    assert a.num_cached_free == 1
    assert a.allocate(1) == [y] and evicted == [b"y"] and a.lookup(b"y") is None
    assert a.allocate(1) is None  # x and z are referenced
    assert a.lookup(b"x") == x and not a.register(z, b"x")  # one block per content


# ---- through the engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.float32, progress=False)


def _engine(model, **kw) -> Engine:
    args = dict(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20, block_size=B)
    args.update(kw)
    return Engine(model, EngineConfig(**args))


def _round(engine: Engine, first_id: int, prompts: list[list[int]], params: SamplingParams = PARAMS):
    """Submit the prompts together, step until all finish: [(tokens, logprobs)] in order."""
    for i, p in enumerate(prompts):
        engine.add_request(first_id + i, p, params)
    toks: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    lps: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    while engine.has_work:
        for d in engine.step().deltas:
            toks[d.request_id - first_id] += d.token_ids
            lps[d.request_id - first_id] += list(d.logprobs or [])
    return [(toks[i], lps[i]) for i in range(len(prompts))]


def _one(engine: Engine, rid: int, prompt: list[int], params: SamplingParams = PARAMS):
    return _round(engine, rid, [prompt], params)[0]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_clean(engine: Engine) -> None:
    m = engine.cache.manager
    assert m.full.num_used == 0 and m.sliding.num_used == 0
    assert int(m.full.refcount.sum()) == 0 and int(m.sliding.refcount.sum()) == 0


@pytest.mark.parametrize("snapshots, k", [(None, 0), (0, 0), (None, 2)], ids=["restore", "replay", "restore-mtp"])
def test_exact_hits_equal_a_cold_run(model, snapshots, k):
    """A conversation's turns (each resends the last prompt and its answer, plus new tokens) and
    prompts ending at every offset in a block after the hit (inside and at compress windows):
    tokens equal the plain reference's, logprobs within the chunked-prefill tolerance (the
    computed chunks differ in shape, nothing else). `replay`: no snapshots, every hit
    recomputes the window stack's receptive field. `restore-mtp`: with MTP speculation (its
    window is restored too, and drafts are verified against the restored state)."""
    engine = _engine(model, prefix_snapshots=snapshots, speculative_tokens=k, adaptive_speculation=False)
    base = _tokens(80, 1)
    turn0 = base[:53]
    got = [_one(engine, 0, turn0)]  # caches blocks 0..2 and the state at 48
    turn1 = turn0 + got[0][0] + _tokens(5, 10)  # the next turn: prompt + answer + a tool output
    got += _round(engine, 1, [turn1, base[:65]])  # hits at 48; base[:65] caches block 3, state at 64
    turn2 = turn1 + got[1][0] + _tokens(11, 11)
    # Hits at 64 (or 48) for prompts ending 4, 8 and 16 tokens past the hit, inside and at the
    # compress windows (4, 8) and the window (8); the conversation's third turn.
    later = [base[:68], base[:72], base[:80], turn2]
    got += _round(engine, 3, later)
    prompts = [turn0, turn1, base[:65], *later]
    ref = generate(model, prompts, PARAMS)
    for (toks, lps), r in zip(got, ref):
        assert toks == r.token_ids
        assert max(abs(a - b) for a, b in zip(lps, r.logprobs)) <= 1e-5
    st = engine.prefix_cache.stats
    assert st.hit_requests >= 3 and st.hits > 0
    if snapshots is None:
        assert st.restores > 0 and st.replayed_tokens == 0
    else:
        assert st.restores == 0 and st.replays == st.hit_requests
        assert st.replayed_tokens >= st.hit_requests * engine.prefix_cache.receptive_field // 2
    assert st.queries == sum(len(p) for p in prompts)
    if k:
        assert engine.stats.spec_draft_tokens > 0
    _assert_clean(engine)


def test_bounded_replay_recomputes_one_window_and_never_rewrites_shared_blocks(model):
    engine = _engine(model, prefix_replay="bounded")
    pc = engine.prefix_cache
    base = _tokens(70, 2)
    _one(engine, 0, base[:50])  # caches blocks 0..2 (tokens [0, 48))
    pools = [p for p in engine.cache.pools.values() if p.spec.group == "full"]
    before = [{k: t.clone() for k, t in p.tensors.items()} for p in pools]
    toks, _ = _one(engine, 1, base[:66])
    assert pc.stats.replays == 1 and pc.stats.replayed_tokens == pc.bounded_tokens
    assert pc.stats.hits == 48 - pc.bounded_tokens
    assert len(toks) == PARAMS.max_tokens
    hashes, parent = [], b""
    salt = pc.salt(None)
    for i in range(3):
        parent = block_hash(parent, base[i * B : (i + 1) * B], salt)
        hashes.append(parent)
    ids = engine.cache.manager.match(hashes)
    assert len(ids) == 3
    for p, old in zip(pools, before):  # the replay recomputed [40, 48) but wrote none of its records
        for k, t in p.tensors.items():
            assert torch.equal(t[ids], old[k][ids]), f"pool {p.spec.name} layer {k} changed in a cached block"
    _assert_clean(engine)


def test_a_different_cache_salt_never_hits(model):
    engine = _engine(model)
    prompt = _tokens(40, 3)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    _one(engine, 0, prompt, SamplingParams(max_tokens=1, ignore_eos=True, cache_salt="tenant-a"))
    st = engine.prefix_cache.stats
    for rid, salt in enumerate([None, "tenant-b"], 1):
        _one(engine, rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True, cache_salt=salt))
        assert st.hit_requests == 0
    _one(engine, 3, prompt, SamplingParams(max_tokens=1, ignore_eos=True, cache_salt="tenant-a"))
    _one(engine, 4, prompt, one)
    assert st.hit_requests == 2 and st.hits == 2 * 32
    _assert_clean(engine)


def test_pressure_preemption_and_abort_leak_nothing(model):
    """Requests sharing prefixes on a pool too small for them all: cached blocks are evicted and
    requests preempted, some are aborted mid-way; the rest equal the reference and nothing leaks."""
    engine = _engine(model, num_kv_blocks=5, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=8, ignore_eos=True)  # decode crosses blocks: running requests grow
    a, b = _tokens(60, 4), _tokens(60, 5)  # two prefix families: a's blocks must evict b's
    prompts = [a[: 20 + 9 * i] for i in range(4)] + [b[: 33 + 9 * i] for i in range(3)]
    out: dict[int, list[int]] = {}
    for wave in (range(4, 7), range(4)):  # each wave at once: more than the pool holds
        for i in wave:
            engine.add_request(i, prompts[i], params)
        while engine.has_work:
            for d in engine.step().deltas:
                out.setdefault(d.request_id, []).extend(d.token_ids)
            if 1 in out and 1 in engine.scheduler.requests:
                engine.abort(1)  # while decoding (its prompt's blocks are cached by now)
            if 3 in engine.scheduler.requests:
                engine.abort(3)  # after one step: waiting or mid-prefill
    ref = generate(model, prompts, params)
    for i in (0, 2, 4, 5, 6):
        assert out[i] == ref[i].token_ids
    assert engine.cache.manager.full.num_evicted > 0 and engine.stats.num_preemptions > 0
    assert engine.prefix_cache.stats.hit_requests > 0
    _assert_clean(engine)
