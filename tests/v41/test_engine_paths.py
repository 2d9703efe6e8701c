"""Every engine path beside the plain V4.1 reference forward (tests/v41), on a `make-model
--arch v41 --preset tiny --quantize fp8-fp4` checkpoint.

Both run under row-independent numerics, where a token's result does not depend on the chunk
or batch it is computed in, so the engine's batched, chunked, preempted (recomputed) and
DSpark-verified runs must give the reference's greedy tokens and, since nothing is approximated,
its chosen-token logprobs exactly. Partial acceptance is forced with drafts that are right for
two positions, so speculative rollback of the window rows, the ratio-2 compressor tail and the
Engram history is exercised. The decoder-tail approximation must leave the global KV (written
by the sources for every token) identical to the exact prefill's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.v41.attention import Chunk
from engine.v41.checkpoint import write_v41_checkpoint
from engine.v41.kv_cache import V41KVCache
from engine.v41.numerics import Numerics
from engine.weights import load_model
from tests.v41.engine_helpers import load, run_engine
from tests.v41.ref_attention import RefOptions
from tests.v41.ref_generate import greedy_generate
from tests.v41.reference_model import ReferenceV41
from tests.v41.release_checkpoint import load_release_checkpoint

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41") / "tiny", "tiny", seed=3, quantize="fp8-fp4")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (45, 23, 9)]


@pytest.fixture(scope="module")
def expected(tiny, prompts):
    """(tokens, chosen logprobs) per prompt from the plain reference, each prompt alone."""
    ref = ReferenceV41(load_release_checkpoint(tiny), options=RefOptions(row_independent=True))
    out = []
    for p in prompts:
        gen = greedy_generate(ref, p, MAX_TOKENS, with_drafts=False)
        out.append((gen.tokens, gen.logprobs.gather(1, torch.tensor(gen.tokens)[:, None])[:, 0]))
    return out


@pytest.fixture(scope="module")
def model(tiny):
    return load(tiny, row_independent=True)


def assert_same(run, expected):
    for i, (tokens, logprobs) in enumerate(expected):
        assert run.tokens[i] == tokens, f"prompt {i}"
        assert torch.equal(torch.tensor(run.logprobs[i]), logprobs), f"prompt {i}"


def test_batched(model, prompts, expected):
    assert_same(run_engine(model, prompts, MAX_TOKENS), expected)


def test_chunked_prefill(model, prompts, expected):
    """A 7-token budget: prompts split mid ratio-2 group and mid candidate block, mixed with decodes."""
    assert_same(run_engine(model, prompts, MAX_TOKENS, max_num_batched_tokens=7), expected)


def test_preempted_and_recomputed(model, prompts, expected):
    run = run_engine(model, prompts, MAX_TOKENS, num_kv_blocks=10, block_size=8)
    assert run.engine.stats.num_preemptions >= 1
    assert_same(run, expected)


def test_dspark_verification(model, prompts, expected):
    k = model.cfg.v41.dspark_block_size
    run = run_engine(model, prompts, MAX_TOKENS, speculative_tokens=k)
    assert_same(run, expected)
    assert run.engine.stats.spec_drafts > 0


def test_partial_acceptance_rolls_back(model, prompts, expected):
    """Drafts right at two positions, then wrong: each verification accepts two and rolls back."""
    k = model.cfg.v41.dspark_block_size
    truth = {i: t for i, (t, _) in enumerate(expected)}

    def override(req, accepted, drafts):
        done = len(req.output_token_ids) + len(accepted)
        right = truth[req.request_id][done:done + 2]
        return right + [(t + 1) % model.cfg.vocab_size for t in truth[req.request_id][done + 2:done + k]]

    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=96, block_size=16,
                                        speculative_tokens=k, adaptive_speculation=False, max_model_len=512))
    engine.runner.draft_override = override
    from ipc.messages import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0))
    tokens = {i: [] for i in range(len(prompts))}
    while engine.has_work:
        for d in engine.step().deltas:
            tokens[d.request_id] += d.token_ids
    assert [tokens[i] for i in range(len(prompts))] == [t for t, _ in expected]
    accepted = engine.stats.spec_accepted_per_position
    assert accepted[0] > 0 and accepted[1] > 0 and accepted[2] == 0


def test_decoder_tail_keeps_the_global_kv(model, prompts):
    """--decoder-tail approx: the sources still write every token's compressed KV and keys."""
    p = prompts[0]
    written = {}
    for mode in (None, model.cfg.sliding_window):
        model.tail_rows = mode
        cache = V41KVCache.for_model(model, "auto", 1, 256, num_full_blocks=16, block_size=16)
        seq = cache.new_sequence()
        cache.allocate(seq, 0, len(p))
        out = model(torch.tensor(p), [Chunk(seq, 0, 0, len(p))])
        assert out.x.shape[0] == (len(p) if mode is None else mode)
        written[mode] = {s: (seq.entries(s).read(len(p) // model.cfg.compress_ratios[s]),
                             seq.keys(s).read(len(p) // model.cfg.compress_ratios[s]))
                         for s in model.cfg.v41.kv_source_layers}
    model.tail_rows = None
    exact, approx = written.values()
    for s in exact:
        assert torch.equal(exact[s][0], approx[s][0]) and torch.equal(exact[s][1], approx[s][1])


def test_decoder_tail_never_reads_window_rows_it_did_not_compute(model, prompts):
    """--decoder-tail approx: the tail layers' queries attend no window row below the kept rows
    (those were not computed in this forward): a pool of recycled bytes (NaN here) gives what a
    zeroed pool gives. Before, a reused pool's stale rows turned the logits non-finite."""
    p = prompts[0]
    assert len(p) > model.cfg.sliding_window  # the tail is cut
    outs = []
    model.tail_rows = model.cfg.sliding_window
    try:
        for garbage in (False, True):
            cache = V41KVCache.for_model(model, "auto", 1, 256, num_full_blocks=16, block_size=16)
            for pool in cache.pools.values():
                for t in pool.tensors.values():
                    if garbage:
                        t.fill_(float("nan")) if t.is_floating_point() else t.fill_(255)
                    else:
                        t.zero_()
            seq = cache.new_sequence()
            cache.allocate(seq, 0, len(p))
            outs.append(model(torch.tensor(p), [Chunk(seq, 0, 0, len(p))]).x)
    finally:
        model.tail_rows = None
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])


def test_engram_tables_in_host_memory(tiny, prompts, expected):
    """--engram-tables host: the tables are allocated on the host, never on the model's device
    (checked on the meta device, which allocates nothing), and the engine's tokens and logprobs
    still equal the plain reference's."""
    from engine.config import ModelConfig
    from engine.v41.weights import _materialize, build_v41

    meta = build_v41(ModelConfig.from_model_dir(tiny), with_dspark=False)
    _materialize(meta, "meta", "host")
    tables = {f"{p}.{n}" for p, m in meta.named_modules() if p.endswith(".engram.embed")
              for n, _ in m.named_parameters()}
    assert tables and all((t.device.type == "cpu") == (name in tables)
                          for name, t in list(meta.named_parameters()) + list(meta.named_buffers()))
    host = load_model(tiny, progress=False, engram_tables="host")
    for block in host.layers:  # the tables are the checkpoint file's mapped pages, not copies
        if getattr(block, "engram", None) is not None:
            for t in (block.engram.embed.weight, block.engram.embed.scale):
                assert _mapped_file(t.data_ptr()).endswith(".safetensors")
    host.numerics = Numerics(row_independent=True)
    assert_same(run_engine(host, prompts, MAX_TOKENS), expected)


def _mapped_file(address: int) -> str:
    """The file mapped at `address` in this process ('' for anonymous memory), from /proc."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5] if len(fields) > 5 else ""
    return ""


def test_batch_invariant_makes_dspark_lossless_in_the_default_numerics(tiny, prompts, expected):
    """The default (reference) numerics give a 2-row verify chunk other fp32 bits than a 1-row
    decode, so speculation may change greedy output; --batch-invariant switches the model to its
    row-independent numerics: with DSpark the tokens and logprobs equal the plain reference's."""
    from engine.config import ConfigError, EngineConfig
    from engine.engine import Engine

    default = load(tiny)
    assert not default.numerics.row_independent
    k = default.cfg.v41.dspark_block_size
    run = run_engine(default, prompts, MAX_TOKENS, speculative_tokens=k, batch_invariant=True)
    assert default.numerics.row_independent and run.engine.stats.spec_drafts > 0
    assert_same(run, expected)
    with pytest.raises(ConfigError, match="V4.1 only"):
        Engine(SimpleNamespace(cfg=SimpleNamespace(arch="v4")), EngineConfig(batch_invariant=True))
