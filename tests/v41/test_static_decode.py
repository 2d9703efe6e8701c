"""V4.1's static-shape decode/verify step (engine/v41/static_decode.py) on CPU, where it runs the
same static programs a GPU captures, against two independent references:

  * DeepSeek's golden outputs (`shared/golden/deepseek-v4.1/c*`, reference numerics): greedy
    tokens identical to REF's for every prompt, with and without DSpark (k = the block size),
    chosen-token logprobs within the golden test's bound (0.5 nats), every decode/verify step in
    static shapes and one host read per step;
  * the eager per-chunk path in the same run, under --batch-invariant (row-independent)
    numerics: tokens, logprobs and every piece of sequence state (window rows of every layer
    and DSpark stage, compressor tails, compressed entries and index keys, Engram history)
    bit-identical after every step, with batches padded to a larger shape, contexts crossing a
    bucket, a sequence shorter than the window, verifications forced to accept two drafts of
    four (rollback), bf16 and FP8/FP4-record KV pools. The fast (kernel) numerics' grouped MoE
    too.

Under reference numerics the static step and the eager one are not bit-identical: torch.topk's
choice among tied index scores depends on the row's width (eager: the sequence's own entries,
static: every entry the shape's table addresses), so after the first tie at a top-k cut-off the
two drift apart within the golden bounds (the golden comparisons treat such ties as equal).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.engine import Engine
from engine.v41.checkpoint import write_v41_checkpoint
from engine.v41.numerics import Numerics
from ipc.messages import SamplingParams
from tests.host_syncs import count_host_reads
from tests.v41.engine_helpers import load, run_engine, use_static_decode

LOGPROB_BOUND = 0.5  # as tests/v41/test_engine_golden.py


# ---- the golden data ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["c1", "c2"])
def golden(request, golden_root):
    d = golden_root / request.param
    g = json.loads((d / "golden.json").read_text())
    return request.param, g, load_file(str(d / "logprobs.safetensors")), load(d)


def _assert_golden(name, g, logprobs, run, prompts: int) -> None:
    assert run.tokens == g["tokens"][:prompts]
    worst = []
    for i, tokens in enumerate(g["tokens"][:prompts]):
        ref = logprobs[f"prompt{i}"].gather(1, torch.tensor(tokens)[:, None])[:, 0]
        worst.append(float((torch.tensor(run.logprobs[i]) - ref).abs().max()))
    print(f"\n{name} static: max |Δ chosen logprob| per prompt {[round(x, 4) for x in worst]}")
    assert max(worst) <= LOGPROB_BOUND
    engine = run.engine
    # every step after the prefill ran in static shapes; every step read the host once
    assert engine.runner.num_static_steps == engine.stats.steps - 1
    assert engine.runner.num_host_reads == engine.stats.steps


def test_golden_tokens_static(golden):
    name, g, logprobs, model = golden
    run = run_engine(model, g["prompts"], g["max_new_tokens"], static=True)
    _assert_golden(name, g, logprobs, run, len(g["prompts"]))


def test_golden_tokens_static_with_dspark(golden):
    """The two shorter prompts (as the eager golden test), drafting and verifying k = block size."""
    name, g, logprobs, model = golden
    k = model.cfg.v41.dspark_block_size
    run = run_engine(model, g["prompts"][:2], g["max_new_tokens"], static=True, speculative_tokens=k)
    _assert_golden(name, g, logprobs, run, 2)
    assert run.engine.stats.spec_drafts > 0 and len(run.engine.stats.spec_accepted_per_position) == k


# ---- static vs eager, row-independent numerics --------------------------------------------------------

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41-static") / "tiny", "tiny", seed=3, quantize="fp8-fp4")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (60, 23, 5)]


def sequence_state(engine: Engine, request) -> dict[str, torch.Tensor]:
    """What a later step of `request` reads of the positions computed for its tokens (all but
    the newest, whose KV the next step computes)."""
    cache, seq, cfg = engine.cache, request.seq, engine.model.cfg
    length, w = len(request.token_ids) - 1, cfg.sliding_window
    layers = [layer for layer in cache.layout.pool("swa").layers  # the backbone's, then each DSpark stage's
              if layer < cfg.num_layers or engine.runner.dspark is not None]
    state = {f"window{layer}": seq.window(layer).read(max(0, length - w), length) for layer in layers}
    for s in cfg.v41.kv_source_layers:
        m = cfg.compress_ratios[s]
        state[f"entries{s}"], state[f"keys{s}"] = seq.entries(s).read(length // m), seq.keys(s).read(length // m)
        if m > 1:
            state[f"tail{s}"] = seq.tail(s).read(length - length % m, length)
    state["engram"] = seq.engram.look_back(length, engine.model.hasher.lookback)
    return state


def _twin_engines(model, prompts, k: int, static_sizes=None, override=None, max_tokens: int = MAX_TOKENS,
                  kv_dtype: str = "auto"):
    """An eager and a static engine (in that order) with the same requests."""
    engines = []
    for static in (False, True):
        engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=96,
                                            block_size=16, speculative_tokens=k, adaptive_speculation=False,
                                            max_model_len=512, kv_dtype=kv_dtype))
        if static:
            use_static_decode(engine, static_sizes)
        engine.runner.draft_override = override
        for i, p in enumerate(prompts):
            engine.add_request(i, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0))
        engines.append(engine)
    return engines


def _step_in_lockstep(eager: Engine, static: Engine) -> None:
    """Step both to the end; after every step the outputs and every running request's state agree."""
    while eager.has_work:
        a, b = eager.step(), static.step()
        assert [(d.request_id, d.token_ids, d.logprobs) for d in a.deltas] == \
               [(d.request_id, d.token_ids, d.logprobs) for d in b.deltas]
        for ra, rb in zip(eager.scheduler.running, static.scheduler.running):
            sa, sb = sequence_state(eager, ra), sequence_state(static, rb)
            for name in sa:
                assert torch.equal(sa[name], sb[name]), f"request {ra.request_id}: {name}"
    assert not static.has_work


@pytest.mark.parametrize("k,kv_dtype", [(0, "auto"), (4, "fp8")], ids=["decode-bf16-kv", "dspark-fp8-kv"])
def test_static_equals_eager_bit_for_bit(tiny, prompts, k, kv_dtype):
    """Three sequences in a shape of four (a padding row); the 60-token prompt crosses the
    64-position context bucket; the 5-token one is shorter than the window (DSpark reads a
    partial window). With DSpark every verification is forced to accept two drafts of four; its
    KV pools hold V4.1's FP8 / FP4 records."""
    model = load(tiny, row_independent=True)
    assert k in (0, model.cfg.v41.dspark_block_size)
    truth = run_engine(model, prompts, MAX_TOKENS).tokens  # greedy: what every verification must reproduce

    def two_right(req, accepted, drafts):
        done = len(req.output_token_ids) + len(accepted)
        right = truth[req.request_id][done:done + 2]
        return right + [(t + 1) % model.cfg.vocab_size for t in truth[req.request_id][done + 2:done + k]]

    eager, static = _twin_engines(model, prompts, k, static_sizes=(4,), override=two_right if k else None,
                                  kv_dtype=kv_dtype)
    _step_in_lockstep(eager, static)
    # the prefill runs eagerly, and so does a verification whose requests draft different counts
    # (the scheduler cuts drafts at max_tokens)
    assert static.runner.num_static_steps >= static.stats.steps - 2 >= 2
    assert static.static.batch_sizes == [4]
    if k:
        accepted = static.stats.spec_accepted_per_position
        assert accepted[0] > 0 and accepted[1] > 0 and accepted[2] == 0


def test_fast_numerics_grouped_moe_equals_eager(tiny, prompts):
    """Numerics(exact=False): the static MoE's grouped GEMMs over expert-sorted pairs give the
    eager per-expert products' bits (row-independent kernels)."""
    model = load(tiny, row_independent=True)
    model.numerics = Numerics(row_independent=True, exact=False)
    eager, static = _twin_engines(model, prompts[1:], 0, max_tokens=6)
    _step_in_lockstep(eager, static)


def test_a_static_step_syncs_once(tiny, prompts):
    """The CPU stand-in for the GPU's sync count (tests/host_syncs.py): a static decode or
    verify step with DSpark drafting makes one wait for the device, its read of the results."""
    model = load(tiny, row_independent=True)
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=96, block_size=16,
                                        speculative_tokens=model.cfg.v41.dspark_block_size,
                                        adaptive_speculation=False, max_model_len=512))
    use_static_decode(engine)
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill (eager forward, static drafting)
    while engine.has_work:
        before = engine.runner.num_static_steps
        with count_host_reads() as calls:
            engine.step()
        assert engine.runner.num_static_steps == before + 1
        assert len(calls) == 1 and calls[0].startswith("PendingRead.wait"), calls
