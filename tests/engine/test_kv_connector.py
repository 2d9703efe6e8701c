"""The KV connector between two engines in this process: a prefill engine and a decode engine,
each with its own NIXL agent (UCX tcp on loopback) and its own KV pools, against a third,
colocated engine as the reference.

The decode engine's pools are poisoned (every byte 0xFF: NaN in fp32) before anything runs, so
a row the transfer plan leaves out but the decode reads would show up as different tokens or
non-finite logits. Each test ends with neither engine holding a block, a lease or a load.
"""
from __future__ import annotations

import time

import msgspec
import pytest
import torch

pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed")

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.kv_connector import attach_connector  # noqa: E402
from engine.kv_layout import build_layout  # noqa: E402
from engine.kv_transfer.config import KVTransferConfig  # noqa: E402
from engine.kv_transfer.plan import make_plan  # noqa: E402
from engine.request import RequestError  # noqa: E402
from engine.weights import load_model  # noqa: E402
from ipc.kv_transfer_params import KVTransferParams  # noqa: E402
from ipc.messages import Finished, SamplingParams  # noqa: E402
from pd_engines import collect, poison_pools, ucx_environment  # noqa: E402

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20, block_size=16)
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)
LEG1 = KVTransferParams(do_remote_decode=True)


@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    """(prefill, decode, colocated) engines on one tiny model; single-threaded (2 shared cores)."""
    with ucx_environment():
        yield from _engines(checkpoint_factory)


def _engines(checkpoint_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    import numba

    numba_threads = numba.get_num_threads()
    numba.set_num_threads(1)
    model = load_model(checkpoint_factory("tiny-upstream", index_topk=64), dtype=torch.float32, progress=False)
    kv = KVTransferConfig(model_id="tiny@test", lease_s=5.0, idle_peer_s=60.0)
    pre = Engine(model, EngineConfig(**ENGINE, kv_transfer=msgspec.structs.replace(kv, role="prefill")))
    dec = Engine(model, EngineConfig(**ENGINE, kv_transfer=msgspec.structs.replace(kv, role="decode")))
    col = Engine(model, EngineConfig(**ENGINE))
    attach_connector(pre)
    attach_connector(dec)
    poison_pools(dec)
    try:
        yield pre, dec, col
    finally:
        dec.connector.close()
        pre.connector.close()
        torch.set_num_threads(threads)
        numba.set_num_threads(numba_threads)


@pytest.fixture(autouse=True)
def clean_afterwards(request):
    yield
    if "engines" not in request.fixturenames:
        return
    pre, dec, _ = request.getfixturevalue("engines")
    _settle(pre, dec, lambda: not pre.connector.prefill.leases)
    for e in (pre, dec):
        assert (e.cache.manager.full.num_used, e.cache.manager.sliding.num_used) == (0, 0)
        assert not e.scheduler.has_work
    assert not dec.connector.decode.loads and not dec.connector.decode._draining


# ---- driving the engines ---------------------------------------------------------------------
def _settle(pre: Engine, dec: Engine, done, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < end, "engines did not settle"
        pre.step()
        dec.step()


def _prefill(pre: Engine, dec: Engine, rid: int, prompt: list[int], params=GREEDY) -> KVTransferParams:
    pre.add_request(rid, prompt, params, LEG1)
    _, _, done = collect(pre, (dec,), rid)
    assert done.reason in ("length", "stop") and done.kv_transfer_params is not None, done
    return done.kv_transfer_params


def _decode(pre: Engine, dec: Engine, rid: int, prompt: list[int], kv, params=GREEDY):
    dec.add_request(rid, prompt, params, kv)
    return collect(dec, (pre,), rid)


def _colocated(col: Engine, rid: int, prompt: list[int], params=GREEDY):
    col.add_request(rid, prompt, params)
    return collect(col, (), rid)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(1000 * seed + n)).tolist()


def _expected_bytes(layout, n: int) -> int:
    """Bytes a prompt of n tokens needs moved, re-derived here from the attention maths: every
    complete compressed record; window rows [n − W + 1, n); an overlapping compressor's previous
    and partial window [m(⌊n/m⌋ − 1), n); a plain compressor's partial window [m⌊n/m⌋, n)."""
    total = 0
    for p in layout.pools:
        if p.group == "full":
            rows = n // p.tokens_per_record
        elif p.name == "swa":
            rows = min(n, p.window - 1)
        elif p.name.endswith("_hca"):
            rows = n % p.window
        else:  # csa / indexer state, window 2m
            m = p.window // 2
            rows = n - m * max(0, n // m - 1)
        total += rows * p.record_bytes * len(p.layers)
    return total


# ---- PD equals colocated ---------------------------------------------------------------------
# tiny: window 8, compress ratios 4 (CSA) and 8 (HCA), block 16: lengths on and around each edge.
@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 9, 15, 16, 17, 24, 33])
def test_pd_output_and_bytes_equal_colocated(engines, n):
    pre, dec, col = engines
    prompt = _prompt(n)
    want = _colocated(col, 1, prompt)
    kv = _prefill(pre, dec, 2, prompt)
    got = _decode(pre, dec, 3, prompt, kv)
    assert got[:2] == want[:2]  # tokens and logprobs, bit for bit
    assert got[2].reason == want[2].reason == "length"
    layout = dec.cache.layout
    moved = dec.connector.ctx.counters.last_bytes
    assert moved == _expected_bytes(layout, n) == make_plan(layout, n).nbytes
    # Against kv-report's figures: global bytes per token × n, less the incomplete last record of
    # each compressed pool, plus fixed state no larger than the per-sequence state.
    fixed = moved - sum(n // p.tokens_per_record * p.record_bytes * len(p.layers)
                        for p in layout.pools if p.group == "full")
    slack = sum(p.record_bytes * len(p.layers) for p in layout.pools if p.group == "full")
    assert 0 <= layout.global_bytes_per_token * n - (moved - fixed) < slack
    assert 0 < fixed <= layout.per_sequence_bytes


def test_plan_on_the_released_v4_flash_layout_matches_kv_report():
    """V4-Flash, fp8 KV, 8192-token prompt: the moved global bytes are exactly kv-report's
    global bytes per token × n (n is a multiple of every ratio)."""
    from engine.config import ModelConfig
    from pathlib import Path

    cfg = ModelConfig.from_model_dir(Path(__file__).resolve().parents[2] / "engine/configs/deepseek-v4-flash.json")
    layout = build_layout(cfg, "fp8", "bf16", 256)
    for n in (8192, 8192 + 77):
        plan = make_plan(layout, n)
        full = plan.group_bytes("full")
        assert full == _expected_bytes(layout, n) - plan.group_bytes("sliding")
        if n % 128 == 0:
            assert full == layout.global_bytes_per_token * n
        assert plan.group_bytes("sliding") <= layout.per_sequence_bytes
        assert plan.nbytes == _expected_bytes(layout, n)


def test_replay_plan_moves_only_global_rows():
    """V4.1-style: no sliding row crosses and the decode resumes `replay` positions early."""
    from engine.v4.checkpoint import preset_config

    layout = build_layout(preset_config("tiny"), "auto", "fp32", 16)
    plan = make_plan(layout, 40, replay_tokens=12)
    assert plan.group_bytes("sliding") == 0 and plan.resume_from == 28
    assert plan.blocks["sliding"][0] == plan.blocks["sliding"][1]
    assert plan.group_bytes("full") == make_plan(layout, 40).group_bytes("full")


def test_first_token_that_ends_the_request_is_emitted_and_frees_everything(engines):
    pre, dec, col = engines
    prompt = _prompt(20, seed=1)
    first = _colocated(col, 10, prompt)[0][0]
    for params, reason in ((SamplingParams(max_tokens=1), "length"),
                           (SamplingParams(max_tokens=6, stop_token_ids=(first,)), "stop")):
        kv = _prefill(pre, dec, 11, prompt, params)
        tokens, _, done = _decode(pre, dec, 12, prompt, kv, params)
        assert tokens == [first] and done.reason == reason and done.completion_tokens == 1


# ---- faults ----------------------------------------------------------------------------------
def _flip(pre: Engine, kv: KVTransferParams, pool: str, in_plan: bool) -> None:
    """Flip one bit of the prefill's held block: inside the planned bytes, or just past them."""
    plan = make_plan(pre.cache.layout, kv.remote_num_tokens)
    r = plan.range(pool)
    block, offset, nbytes = r.spans()[-1]
    ids, _ = kv.group_blocks(r.group)
    block_id = ids[block - plan.blocks[r.group][0]]
    tensor = pre.cache.pools[pool].tensors[pre.cache.pools[pool].spec.layers[-1]]
    raw = tensor[block_id].view(torch.uint8).reshape(-1)
    raw[offset + nbytes - 1 if in_plan else offset + nbytes] ^= 0x10


@pytest.mark.parametrize("pool", ["c4", "swa", "state_c4_csa"])
def test_a_flipped_bit_aborts_the_request_before_its_first_token(engines, pool):
    pre, dec, _ = engines
    prompt = _prompt(21, seed=2)  # 21 tokens: every pool has bytes in the plan
    kv = _prefill(pre, dec, 20, prompt)
    _flip(pre, kv, pool, in_plan=True)
    failures = dec.connector.ctx.counters.digest_failures
    tokens, _, done = _decode(pre, dec, 21, prompt, kv)
    assert tokens == [] and done.reason == "error" and done.error_code == 502, done
    assert "fail their digest" in done.error and "not used" in done.error
    assert dec.connector.ctx.counters.digest_failures == failures + 1


def test_bytes_outside_the_plan_are_neither_moved_nor_needed(engines):
    pre, dec, col = engines
    prompt = _prompt(21, seed=3)
    want = _colocated(col, 30, prompt)
    kv = _prefill(pre, dec, 31, prompt)
    _flip(pre, kv, "swa", in_plan=False)  # a row of the held block past what the decode reads
    assert _decode(pre, dec, 32, prompt, kv)[:2] == want[:2]


def test_recompute_policy_recovers_a_corrupt_transfer(engines):
    pre, dec, col = engines
    prompt = _prompt(18, seed=4)
    want = _colocated(col, 40, prompt)
    kv = _prefill(pre, dec, 41, prompt)
    _flip(pre, kv, "c4", in_plan=True)
    config = dec.connector.ctx.config
    dec.connector.ctx.config = msgspec.structs.replace(config, failure_policy="recompute")
    try:
        got = _decode(pre, dec, 42, prompt, kv)
    finally:
        dec.connector.ctx.config = config
    assert got[:2] == want[:2]  # prefilled again here, never decoded from the corrupt KV


def test_an_unreachable_prefill_fails_the_request_and_frees_its_blocks(engines):
    pre, dec, _ = engines
    prompt = _prompt(12, seed=5)
    kv = _prefill(pre, dec, 50, prompt)
    from engine.kv_transfer.context import free_port

    dead = msgspec.structs.replace(kv, remote_engine_id="ringserve-prefill-gone", remote_port=free_port())
    config = dec.connector.ctx.config
    dec.connector.ctx.config = msgspec.structs.replace(config, connect_timeout_s=0.5)
    try:
        tokens, _, done = _decode(pre, dec, 51, prompt, dead)
    finally:
        dec.connector.ctx.config = config
    assert tokens == [] and done.reason == "error" and done.error_code == 503
    assert "cannot connect to prefill ringserve-prefill-gone" in done.error
    pre.connector.prefill.release(kv.remote_request_id, "test: the decode went elsewhere")


def test_lease_expires_unless_the_decode_renews_it(engines):
    pre, dec, col = engines
    config = pre.connector.ctx.config
    pre.connector.ctx.config = msgspec.structs.replace(config, lease_s=0.4)
    try:
        prompt = _prompt(10, seed=6)
        kv = _prefill(pre, dec, 60, prompt)  # nobody comes for it
        expired = pre.connector.ctx.counters.expired
        _settle(pre, dec, lambda: not pre.connector.prefill.leases, timeout_s=5.0)
        assert pre.connector.ctx.counters.expired == expired + 1
        assert pre.cache.manager.full.num_used == 0
        time.sleep(0.05)
        with pytest.raises(RequestError, match="already expired"):
            dec.add_request(61, prompt, GREEDY, kv)
        # A decode that waits (no blocks free) renews the lease past its ttl, then decodes.
        want = _colocated(col, 62, prompt)
        kv = _prefill(pre, dec, 63, prompt)
        hog = dec.cache.new_sequence()  # every free full block
        end = 16 * dec.cache.manager.full.num_free
        assert dec.cache.manager.allocate(hog.table, end - 1, end)
        dec.add_request(64, prompt, GREEDY, kv)
        end = time.monotonic() + 1.2  # three lease lifetimes
        while time.monotonic() < end:
            assert dec.step().finished == []
            pre.step()
        assert len(pre.connector.prefill.leases) == 1 and dec.connector.decode.loads
        dec.cache.free(hog)
        assert collect(dec, (pre,), 64)[:2] == want[:2]
    finally:
        pre.connector.ctx.config = config


def test_abort_while_waiting_for_remote_kv_frees_both_sides(engines):
    pre, dec, _ = engines
    prompt = _prompt(30, seed=7)
    _decode(pre, dec, 69, _prompt(5), _prefill(pre, dec, 68, _prompt(5)))  # connected: the abort's KVDone can go
    _settle(pre, dec, lambda: not pre.connector.prefill.leases)  # that run's lease released before counting
    kv = _prefill(pre, dec, 70, prompt)  # after the connecting run: a slow machine must not outlast its lease
    counters = pre.connector.ctx.counters
    released, expired = counters.released, counters.expired
    dec.add_request(71, prompt, GREEDY, kv)
    done = dec.abort(71)
    assert isinstance(done, Finished) and done.reason == "abort"
    _settle(pre, dec, lambda: not pre.connector.prefill.leases, timeout_s=2.0)  # well before the 5 s lease
    assert (counters.released, counters.expired) == (released + 1, expired)  # told, not timed out


@pytest.mark.parametrize("change, match", [
    (lambda kv, p: (msgspec.structs.replace(kv, compat_hash="cd" * 32), p), "compat_hash"),
    (lambda kv, p: (kv, p[:-1] + [(p[-1] + 1) % 500]), "remote_prompt_hash"),
    (lambda kv, p: (kv, p + [5]), "remote_num_tokens"),
    (lambda kv, p: (msgspec.structs.replace(kv, remote_first_token=10**6), p), "vocabulary"),
])
def test_params_that_do_not_fit_this_engine_are_refused(engines, change, match):
    pre, dec, _ = engines
    prompt = _prompt(9, seed=8)
    kv = _prefill(pre, dec, 80, prompt)
    bad, bad_prompt = change(kv, prompt)
    with pytest.raises(RequestError, match=match):
        dec.add_request(81, bad_prompt, GREEDY, bad)
    with pytest.raises(RequestError, match="logprobs"):  # the prefill computed none
        dec.add_request(82, prompt, SamplingParams(max_tokens=4, logprobs=1),
                        msgspec.structs.replace(kv, remote_first_logprob=None, remote_first_top_logprobs=None))
    pre.connector.prefill.release(kv.remote_request_id, "test")


def test_roles_refuse_the_other_sides_leg(engines):
    pre, dec, _ = engines
    with pytest.raises(RequestError, match="does not prefill"):
        dec.add_request(90, [3, 4, 5], GREEDY, LEG1)
    kv = _prefill(pre, dec, 91, [3, 4, 5])
    with pytest.raises(RequestError, match="does not decode"):
        pre.add_request(92, [3, 4, 5], GREEDY, kv)
    pre.connector.prefill.release(kv.remote_request_id, "test")


# ---- replay (V4.1-style: only global rows cross) ---------------------------------------------
@pytest.fixture(scope="module")
def replay_engines(engines, checkpoint_factory):
    """A prefill/decode pair with --kv-replay-tokens 16 (both sides: it is part of the
    compatibility hash), and the colocated engine as the reference."""
    _, _, col = engines
    model = col.model
    kv = KVTransferConfig(model_id="tiny@test", lease_s=5.0, idle_peer_s=60.0, replay_tokens=16)
    pre = Engine(model, EngineConfig(**ENGINE, kv_transfer=msgspec.structs.replace(kv, role="prefill")))
    dec = Engine(model, EngineConfig(**ENGINE, kv_transfer=msgspec.structs.replace(kv, role="decode")))
    attach_connector(pre)
    attach_connector(dec)
    try:
        yield pre, dec, col
    finally:
        dec.connector.close()
        pre.connector.close()


def test_replay_covering_the_whole_prompt_equals_colocated_and_moves_only_global_rows(replay_engines):
    """n ≤ replay: the decode recomputes every position from the global rows it was sent (which
    the replay rewrites), so greedy tokens are the colocated ones; the logprobs agree to float
    rounding only (the replay computes prompt + first token as one chunk of 13 positions, the
    colocated engine 12 then 1). No sliding row crosses."""
    pre, dec, col = replay_engines
    prompt = _prompt(12, seed=5)
    want = _colocated(col, 51, prompt)
    kv = _prefill(pre, dec, 52, prompt)
    assert kv.group_blocks("sliding")[0] == []
    got = _decode(pre, dec, 53, prompt, kv)
    assert got[0] == want[0] and got[2].reason == "length"
    assert got[1] == pytest.approx(want[1], abs=1e-5)
    assert dec.connector.ctx.counters.last_bytes == make_plan(dec.cache.layout, 12, 16).nbytes
    _settle(pre, dec, lambda: not pre.connector.prefill.leases)
    for e in (pre, dec):
        assert (e.cache.manager.full.num_used, e.cache.manager.sliding.num_used) == (0, 0)


def test_bounded_replay_of_a_longer_prompt_completes_and_frees_everything(replay_engines):
    """n > replay: positions before the replay point reach the decode only as global rows, so
    the window rows the first replayed positions read are the decode's own (an approximation,
    like vLLM's bounded replay for V4.1); the request must still run to the end and free."""
    pre, dec, _ = replay_engines
    prompt = _prompt(40, seed=6)
    kv = _prefill(pre, dec, 54, prompt)
    tokens, logprobs, done = _decode(pre, dec, 55, prompt, kv)
    assert done.reason == "length" and len(tokens) == GREEDY.max_tokens
    assert all(lp == lp and lp <= 0 for lp in logprobs)  # finite (no NaN) log-probabilities
    assert dec.connector.ctx.counters.last_bytes == make_plan(dec.cache.layout, 40, 16).group_bytes("full")
    _settle(pre, dec, lambda: not pre.connector.prefill.leases)
    for e in (pre, dec):
        assert (e.cache.manager.full.num_used, e.cache.manager.sliding.num_used) == (0, 0)
