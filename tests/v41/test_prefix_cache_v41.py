"""Prefix caching on DeepSeek-V4.1 (a `make-model --arch v41 --preset tiny` checkpoint: window 8,
compress ratios 2 and 1 shared CSA2-style, Engram 3-grams, three DSpark stages; blocks of 16).

Row-independent numerics make a token's result independent of the chunk or batch it is computed
in, so a prefix-cached run must give the cold run's (caching off) greedy tokens and chosen-token
logprobs exactly, whichever way its sliding state (window rows, DSpark windows) was rebuilt:
restored from a snapshot or replayed over the window stack's receptive field (the backbone's
window layers; the DSpark stages add none — and a block less is not exact); and the Engram
history at the hit must be right (a wrong look-back changes the hashed n-grams, so the tokens).
Shared global records are never rewritten, eviction under pressure never touches a block a
running request reads, bounded replay runs (its divergence from cold is printed), and the V4.1
salt differs from V4's and between KV formats.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.prefix_cache import model_salt
from engine.v41.checkpoint import write_v41_checkpoint
from engine.weights import load_model
from ipc.messages import SamplingParams
from tests.v41.engine_helpers import load, run_engine

B = 16  # block size of every engine here
MAX_TOKENS = 4
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_v41_checkpoint(tmp_path_factory.mktemp("v41pc") / "tiny", "tiny", seed=3, quantize="fp8-fp4")
    return load(path, row_independent=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model, **kw) -> Engine:
    args = dict(max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=96, block_size=B, speculative_tokens=0,
                adaptive_speculation=False, max_model_len=512)
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


def _cold(model, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, **kw) -> list[tuple[list[int], list[float]]]:
    """Every prompt with prefix caching off (the reference: nothing reused)."""
    run = run_engine(model, prompts, max_tokens, enable_prefix_caching=False, **kw)
    return list(zip(run.tokens, run.logprobs))


def _assert_clean(engine: Engine) -> None:
    m = engine.cache.manager
    assert m.full.num_used == 0 and m.sliding.num_used == 0
    assert int(m.full.refcount.sum()) == 0 and int(m.sliding.refcount.sum()) == 0


CASES = {
    "restore": {},
    "replay": dict(prefix_snapshots=0),
    "chunked": dict(max_num_batched_tokens=23),
    "chunked-replay": dict(max_num_batched_tokens=23, prefix_snapshots=0),
    "dspark": dict(speculative_tokens=4),
    "dspark-replay": dict(speculative_tokens=4, prefix_snapshots=0),
}
BASE = _tokens(130, 1)
TURN0 = BASE[:83]


@pytest.fixture(scope="module")
def cold_turns(model):
    """The cold run of every prompt the exact-hit test sends; row-independent numerics make it
    the same for every case's chunking and speculation (tests/v41/test_engine_paths.py)."""
    turn0 = _cold(model, [TURN0])[0]
    turn1 = TURN0 + turn0[0] + _tokens(9, 10)
    rounds = [[TURN0], [BASE[:81], BASE[:85], BASE[:97], turn1], [BASE[:100]]]
    flat = [p for r in rounds for p in r]
    return rounds, [turn0] + _cold(model, flat[1:])


@pytest.mark.parametrize("case", list(CASES))
def test_exact_hits_equal_a_cold_run(model, cold_turns, case):
    """Turn 0 caches blocks 0..4 (and the state at 80). Then, in one round: hits at 80 for a
    prompt one token past it (the hit on a block boundary), 5 past (less than a window) and
    17 past (more than a window), and the conversation's next turn (prompt + answer + new
    tokens); then a hit at 96 (block 5, cached by the 17-past prompt). Tokens and logprobs
    equal the cold run's exactly."""
    kw = CASES[case]
    engine = _engine(model, **kw)
    rounds, cold = cold_turns
    got, rid = [], 0
    for r in rounds:
        got += _round(engine, rid, r)
        rid += len(r)
    prompts = [p for r in rounds for p in r]
    for i, (g, c) in enumerate(zip(got, cold)):
        assert g[0] == c[0], f"prompt {i} (length {len(prompts[i])}): tokens differ from the cold run"
        assert g[1] == c[1], f"prompt {i} (length {len(prompts[i])}): logprobs differ from the cold run"
    st, pc = engine.prefix_cache.stats, engine.prefix_cache
    print(f"\n{case}: {st.hit_requests} hits, {st.hits / st.hit_requests:.1f} cached tokens and "
          f"{st.replayed_tokens / st.hit_requests:.1f} recomputed per hit (receptive field {pc.receptive_field})")
    assert st.hit_requests == 5 and st.queries == sum(map(len, prompts))
    if "prefix_snapshots" in kw:
        assert st.restores == 0 and st.replays == st.hit_requests
        # The receptive field by hand: the backbone's n window layers chain, W − 1 rows each, and
        # the last one reads W − 1 rows before H; the DSpark stages (fed by backbone states at
        # their own positions) add none: (n − 1)·(W − 1) + (W − 1), not (n + stages − 1)·(W − 1) + …
        cfg = model.cfg
        assert pc.receptive_field == cfg.num_layers * (cfg.sliding_window - 1) == 42
        # each replay starts ≤ R − 1 + B below its hit (R rounded down to a block)
        assert st.replayed_tokens >= st.hit_requests * (pc.receptive_field - B)
    else:
        assert st.restores == st.hit_requests and st.replayed_tokens == 0
        assert st.hits == 80 * 4 + 96
    if kw.get("speculative_tokens"):
        assert engine.stats.spec_draft_tokens > 0
    _assert_clean(engine)


def test_a_replay_one_block_short_of_the_receptive_field_is_not_exact(model, cold_turns):
    """The check above can fail: with R understated by a block, the replay for the hit at 80
    starts at 48 instead of 32, window rows before H are no longer exact, and the prompt one
    token past the hit leaves the cold run (DSpark on: its windows are replayed too)."""
    rounds, cold = cold_turns
    engine = _engine(model, speculative_tokens=4, prefix_snapshots=0)
    engine.prefix_cache.receptive_field -= B
    _round(engine, 0, rounds[0])
    (tokens, logprobs), = _round(engine, 1, [rounds[1][0]])  # BASE[:81]
    assert engine.prefix_cache.stats.replays == 1
    assert (tokens, logprobs) != cold[1]


def test_fp8_records_restore_exactly(model):
    """--kv-dtype fp8: the window is stored as the model's e4m3 records; a restored snapshot
    holds those bytes, so a hit still equals cold."""
    engine = _engine(model, kv_dtype="fp8", max_num_seqs=2)
    prompts = [BASE[:19], BASE[:22]]  # the second restores the state at 16 (window rows 9..15)
    params = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=0)
    got = [_round(engine, i, [p], params)[0] for i, p in enumerate(prompts)]
    cold = run_engine(model, prompts, 2, enable_prefix_caching=False, kv_dtype="fp8", max_num_seqs=2)
    assert [t for t, _ in got] == cold.tokens and [lp for _, lp in got] == cold.logprobs
    assert engine.prefix_cache.stats.restores == 1
    _assert_clean(engine)


def test_preemption_on_a_tiny_pool_equals_cold(model):
    """Prompts of two prefix families at once on a pool too small for them: requests are
    preempted and re-admitted on their cached prefix, cached blocks are evicted; every output
    equals the cold run's and nothing leaks."""
    engine = _engine(model, num_kv_blocks=12, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)  # decodes cross blocks
    a, b = _tokens(100, 4), _tokens(100, 5)
    _round(engine, 0, [a[:50]], SamplingParams(max_tokens=1, ignore_eos=True))  # caches a's blocks 0..2
    prompts = [a[:70], a[:61], b[:66], b[:49]]
    got = _round(engine, 1, prompts, params)
    cold = run_engine(model, prompts, 8, enable_prefix_caching=False)
    assert [t for t, _ in got] == cold.tokens and [lp for _, lp in got] == cold.logprobs
    assert engine.stats.num_preemptions > 0 and engine.prefix_cache.stats.hit_requests >= 2
    _assert_clean(engine)


def test_eviction_under_pressure_never_touches_blocks_in_use(model):
    """A decoding request runs on adopted cached blocks while other prompts fill the pool and
    force evictions: the global records of every block it holds below its frozen length stay
    byte-identical throughout, and its output equals the cold run's."""
    engine = _engine(model, num_kv_blocks=16, max_num_batched_tokens=128, prefix_snapshots=0)
    a = _tokens(100, 6)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    # a's blocks 0..4 and two other families' blocks 0..1 cached: the eviction candidates
    _round(engine, 0, [a[:90], _tokens(40, 20), _tokens(40, 21)], one)
    n = 8
    holder = engine.add_request(1, a[:95], SamplingParams(max_tokens=n, ignore_eos=True))
    pools = [p for p in engine.cache.pools.values() if p.spec.group == "full"]
    snap, evicted0, out = None, engine.cache.manager.full.num_evicted, {1: []}
    while engine.has_work:
        for d in engine.step().deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)
        table = holder.seq.table if holder.seq is not None else None
        if snap is None and table is not None and table.frozen_tokens:
            ids = table.full[: table.frozen_tokens // B]
            snap = (ids, [{k: t[ids].clone() for k, t in p.tensors.items()} for p in pools])
            for j in range(2):  # new families while it decodes: the pool must evict
                engine.add_request(20 + j, _tokens(50, 30 + j), SamplingParams(max_tokens=2, ignore_eos=True))
        if snap is not None and table is not None and table.frozen_tokens:
            ids, before = snap
            for p, old in zip(pools, before):
                for k, t in p.tensors.items():
                    assert torch.equal(t[ids], old[k]), f"pool {p.spec.name} layer {k}: a held block changed"
    assert snap is not None, "the request never started on a cached prefix"
    assert engine.cache.manager.full.num_evicted > evicted0
    assert engine.stats.num_preemptions == 0  # it held its blocks all along
    cold = run_engine(model, [a[:95]], n, enable_prefix_caching=False)
    assert out[1] == cold.tokens[0]
    _assert_clean(engine)


def test_bounded_replay_runs_never_rewrites_shared_blocks_and_reports_divergence(model):
    """`--prefix-replay bounded` recomputes one bounded window (W_b tokens) before each hit and
    leaves the cached records alone; its greedy output may differ from cold (printed; for a
    larger measurement RINGSERVE_BOUNDED_FAMILIES=n prompt families, 2 lengths each, and
    RINGSERVE_BOUNDED_TOKENS=n tokens per prompt)."""
    families = [_tokens(120, 40 + i) for i in range(int(os.environ.get("RINGSERVE_BOUNDED_FAMILIES", "2")))]
    # room for every block the run ever allocates (≤ 9 per family; freed ones are reused oldest
    # first): nothing cached is evicted before its hit
    engine = _engine(model, prefix_replay="bounded", num_kv_blocks=max(96, 32 + 12 * len(families)))
    pc = engine.prefix_cache
    assert pc.store is None and engine.cache.snapshots is None
    _round(engine, 0, [f[:66] for f in families], SamplingParams(max_tokens=1, ignore_eos=True))  # blocks 0..3
    pools = [p for p in engine.cache.pools.values() if p.spec.group == "full"]
    before = [{k: t.clone() for k, t in p.tensors.items()} for p in pools]
    prompts = [f[:n] for f in families for n in (70, 110)]
    max_tokens = int(os.environ.get("RINGSERVE_BOUNDED_TOKENS", str(MAX_TOKENS)))
    got = _round(engine, len(families), prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0))
    hits = pc.stats.hit_requests
    assert hits == len(prompts) and pc.stats.replayed_tokens == hits * pc.bounded_tokens
    cold = _cold(model, prompts, max_tokens)
    differ = sum(g[0] != c[0] for g, c in zip(got, cold))
    first = [next((i for i, (x, y) in enumerate(zip(g[0], c[0])) if x != y), None) for g, c in zip(got, cold)]
    print(f"\nbounded replay (W_b = {pc.bounded_tokens}, hits at 64): {differ}/{len(prompts)} greedy outputs "
          f"differ from cold within {max_tokens} tokens (first differing token per prompt: {first})")
    assert all(len(g[0]) == max_tokens for g in got)
    # Blocks 0..3 of each family were cached before the round: the replays below 64 wrote none of them.
    ids = [engine.cache.manager.match(_chain(pc, f[:64])) for f in families]
    assert all(len(i) == 4 for i in ids)
    for p, old in zip(pools, before):
        for k, t in p.tensors.items():
            for blocks in ids:
                assert torch.equal(t[blocks], old[k][blocks]), f"pool {p.spec.name} layer {k} changed in a cached block"
    _assert_clean(engine)


def _chain(pc, tokens: list[int]) -> list[bytes]:
    from engine.block_manager import block_hash

    out, parent = [], b""
    for i in range(len(tokens) // B):
        parent = block_hash(parent, tokens[i * B:(i + 1) * B], pc.salt(None))
        out.append(parent)
    return out


def test_v41_salts_differ_from_v4_and_between_kv_formats(model, checkpoint_factory):
    v4 = load_model(checkpoint_factory("tiny-v4-salt"), dtype=torch.float32, progress=False)
    salts = {}
    for kv in ("auto", "fp8"):
        e = _engine(model, kv_dtype=kv, num_kv_blocks=8)
        salts[kv] = e.prefix_cache.model_salt
        assert e.prefix_cache.salt(None) != e.prefix_cache.salt("tenant")
    assert salts["auto"] != salts["fp8"]
    v4_engine = Engine(v4, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=8, block_size=B))
    assert v4_engine.prefix_cache.model_salt not in salts.values()
    # The index-key format is not named by kv_dtype: it must change the V4.1 salt on its own.
    layout = _engine(model, kv_dtype="fp8", num_kv_blocks=8).cache.layout
    formats = {p.name: p.fmt for p in layout.pools}
    swapped = {n: ("fp8_index" if f == "v41_fp4_index" else f) for n, f in formats.items()}
    assert swapped != formats
    assert model_salt(model.cfg, "fp8", B, formats) == salts["fp8"]
    assert model_salt(model.cfg, "fp8", B, swapped) != salts["fp8"]
