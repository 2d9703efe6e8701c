"""The static-shape decode/verify path (what CUDA graphs capture) against the per-sequence path.

On CPU the static forward runs eagerly through the same `DecodeGraphs` object that captures it
on a GPU; these tests pin its maths, its padding and its shape choice. The GPU capture itself
is tested in tests/engine/test_cuda_graphs_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention_backend import StepSeq
from engine.config import EngineConfig
from engine.cuda_graphs import StaticDecodeBackend, context_buckets
from engine.engine import Engine
from engine.kv_cache import KVCache
from engine.v4.attention import SeqSlice, SequenceContext
from engine.weights import load_model
from ipc.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
QUANTIZABLE = dict(head_dim=128, qk_rope_head_dim=64, index_head_dim=64, index_topk=3)


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    # index_topk 2 < entries: the indexer's top-k runs on the static entry axis too.
    return load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.float32, progress=False)


def _prompts(n: int, seed: int = 0, max_len: int = 50) -> list[list[int]]:
    rng = random.Random(seed)
    return [torch.randint(2, 500, (rng.randint(1, max_len),), generator=torch.Generator().manual_seed(seed + i)).tolist()
            for i in range(n)]


def _run(model, prompts, static: bool, params=GREEDY, seed: int = 3, **kw) -> tuple[dict[int, list[int]], Engine]:
    """Requests arrive at random steps (so decode batches change size); id → output tokens."""
    args = dict(max_num_seqs=8, max_num_batched_tokens=40, kv_cache_memory_bytes=4 << 20, block_size=16,
                cuda_graph_sizes=(1, 2, 4), static_decode=static, max_model_len=512)
    args.update(kw)
    engine = Engine(model, EngineConfig(**args))
    rng = random.Random(seed)
    out: dict[int, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_work:
        while pending and (rng.random() < 0.3 or not engine.has_work):
            i, p = pending.pop(0)
            engine.add_request(i, p, params)
        for d in engine.step().deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)
    assert engine.cache.manager.full.num_used == 0 and engine.cache.manager.sliding.num_used == 0
    return out, engine


def test_static_decode_equals_the_per_sequence_path(model):
    """Mixed lengths crossing the window (8) and compress boundaries (4, 8); up to 8 running
    sequences, so batches of 5–8 fall back to eager and batches of 1–4 run static (padded)."""
    prompts = _prompts(16, max_len=90)  # up to 6 blocks of 16: sliding tables longer than a step reads
    eager, _ = _run(model, prompts, static=False)
    static, engine = _run(model, prompts, static=True)
    assert static == eager
    assert 10 < engine.static.num_runs < engine.stats.steps  # both paths really ran


def test_static_verify_is_lossless(model):
    """q = 4 verify steps (3 MTP drafts) through the static path equal greedy without speculation."""
    prompts = _prompts(6, seed=7)
    plain, _ = _run(model, prompts, static=False)
    spec, engine = _run(model, prompts, static=True, speculative_tokens=3, max_num_seqs=4,
                        adaptive_speculation=False)
    assert spec == plain
    assert engine.static.num_runs > 20
    assert engine.stats.spec_drafts > 0
    assert any(key[0] == "mtp" for key in engine.static._shapes)  # draft steps ran static too


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_static_decode_under_quantized_kv(checkpoint_factory, kv_dtype):
    model = load_model(checkpoint_factory("tiny-q", **QUANTIZABLE), dtype=torch.float32, progress=False)
    prompts = _prompts(6, seed=11)
    eager, _ = _run(model, prompts, static=False, kv_dtype=kv_dtype)
    static, engine = _run(model, prompts, static=True, kv_dtype=kv_dtype)
    assert static == eager and engine.static.num_runs > 0


def test_static_decode_with_preemption_and_sampling(model):
    """A pool so small that requests are preempted and recomputed, seeded sampling with logprobs:
    the static path gives the same tokens as the per-sequence path."""
    prompts = _prompts(8, seed=13)
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5, logprobs=2)
    eager, first = _run(model, prompts, static=False, params=params, num_kv_blocks=9)
    static, engine = _run(model, prompts, static=True, params=params, num_kv_blocks=9)
    assert first.stats.num_preemptions > 0 and engine.stats.num_preemptions > 0
    assert static == eager and engine.static.num_runs > 0


@torch.inference_mode()
def test_padding_rows_touch_only_the_dummy_block(model):
    """Every block no live sequence owns is filled with NaN: a padding row (or a masked read)
    that touched one would make the logits NaN, and a stray write would overwrite the NaN."""
    cache = KVCache.for_model(model, "auto", max_num_seqs=4, num_full_blocks=32, block_size=16)
    graphs = StaticDecodeBackend(model, cache, (4,), (1,), 256, capture=False)
    prompt = _prompts(1, seed=5, max_len=40)[0] + [7] * 30  # > window and several compressed entries
    seq = cache.new_sequence()
    assert cache.allocate(seq, 0, len(prompt) + 1)
    model(torch.tensor(prompt), torch.arange(len(prompt)), SequenceContext([SeqSlice(seq, 0, 0, len(prompt))]))
    owned = {"full": set(seq.table.full), "sliding": set(seq.table.sliding)}
    snapshots = {}
    for name, pool in cache.pools.items():
        free = [b for b in range(1, pool.tensors[next(iter(pool.tensors))].shape[0]) if b not in owned[pool.spec.group]]
        for layer, t in pool.tensors.items():
            t[free] = float("nan")
            snapshots[(name, layer)] = (free, t[free].clone())
    # The same history in a second cache, read by the per-sequence path.
    ref_cache = KVCache.for_model(model, "auto", max_num_seqs=4, num_full_blocks=32, block_size=16)
    ref = ref_cache.new_sequence()
    assert ref_cache.allocate(ref, 0, len(prompt) + 1)
    model(torch.tensor(prompt), torch.arange(len(prompt)), SequenceContext([SeqSlice(ref, 0, 0, len(prompt))]))
    expected = model.logits(model(torch.tensor([9]), torch.tensor([len(prompt)]),
                                  SequenceContext([SeqSlice(ref, len(prompt), 0, 1)])))
    step = graphs.prepare([StepSeq(seq, len(prompt), [9])])
    assert step.shape.batch.num_seqs == 4  # one live row, three padding rows
    _, logits = step.run(model, [0])
    assert torch.isfinite(logits).all()
    assert (logits - expected).abs().max().item() < 1e-4
    for (name, layer), (free, before) in snapshots.items():
        after = cache.pools[name].tensors[layer][free]
        assert torch.isnan(after).all() and torch.isnan(before).all(), f"pool {name} layer {layer}: a free block was written"


def test_shape_choice(model):
    cache = KVCache.for_model(model, "auto", max_num_seqs=8, num_full_blocks=32, block_size=16)
    graphs = StaticDecodeBackend(model, cache, (8, 1, 2, 4), (1, 4), 1000, capture=False)
    assert graphs.buckets == [64, 256, 1008]
    assert graphs.shape_for(3, 1, 10) == ("model", 4, 1, 64)  # smallest size and context that hold the batch
    assert graphs.shape_for(1, 4, 65) == ("model", 1, 4, 256)
    assert graphs.shape_for(8, 1, 1008) == ("model", 8, 1, 1008)
    assert graphs.shape_for(9, 1, 10) is None  # above the largest size: eager
    assert graphs.shape_for(2, 2, 10) is None  # q not captured: eager
    assert graphs.shape_for(2, 1, 1009) is None
    assert graphs.mtp_shape_for(3) is None  # draft steps not enabled
    drafting = StaticDecodeBackend(model, cache, (1, 2, 4), (1, 4), 1000, capture=False, draft_steps=True)
    assert drafting.mtp_shape_for(3) == ("mtp", 4, 1, 64) and drafting.mtp_shape_for(5) is None
    assert context_buckets(256, 32768) == [1024, 4096, 16384, 32768]
    with pytest.raises(ValueError, match="cuda-graph-sizes"):
        StaticDecodeBackend(model, cache, (0,), (1,), 1000, capture=False)


class _FakeEvent:
    """A CUDA event stand-in: done once the test says its copy ran."""

    def __init__(self, log):
        self.done, self.log = False, log
        log.append(self)

    def record(self):
        pass

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_host_mirrors_never_rewrite_a_copy_still_queued():
    """A fill takes a mirror whose last copy has run; while every mirror's copy is queued a new
    mirror is added (up to the limit), then the fill waits for the oldest copy."""
    from engine.decode_batch import HostMirrors

    events = []
    mirrors = HostMirrors(4, limit=3, pinned=lambda n: torch.zeros(n, dtype=torch.long),
                          new_event=lambda: _FakeEvent(events))
    order = []
    for _ in range(3):  # three fills, no copy has run: three mirrors
        i = mirrors.take()
        mirrors.copied(i)
        order.append(i)
    assert order == [0, 1, 2] and len(mirrors.mirrors) == 3
    events[1].done = True  # mirror 1's copy ran: it is the one reused
    assert mirrors.take() == 1
    mirrors.copied(1)
    # all three queued and at the limit: the fill waits for the oldest copy (mirror 0's)
    assert mirrors.take() == 0 and events[0].done and not events[2].done
    mirrors.copied(0)
    for e in events:
        e.done = True
    taken = [mirrors.take() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and len(mirrors.mirrors) == 3  # round robin once all are free


def test_a_fill_through_pinned_mirrors_lands_whole(model):
    """DecodeBatch.fill as on CUDA (a mirror, then one copy), run on CPU with stand-in events:
    the device buffer holds the latest fill, padding rows are zero, and a mirror whose copy is
    still queued keeps the earlier fill."""
    import dataclasses

    from engine.decode_batch import DecodeBatch, HostMirrors

    cache = KVCache.for_model(model, "auto", max_num_seqs=4, num_full_blocks=16, block_size=16)
    events = []
    plain = DecodeBatch.allocate(cache, 3, 2, 4, 3)
    mirrors = HostMirrors(plain._device.numel(), limit=4, pinned=lambda n: torch.zeros(n, dtype=torch.long),
                          new_event=lambda: _FakeEvent(events))
    batch = dataclasses.replace(plain, _mirrors=mirrors)
    batch.fill([([5, 6], 10, [1, 2], [3], 0), ([7, 8], 20, [4], [5, 6], 1)])
    first = batch._device.clone()
    batch.fill([([9, 9], 30, [7, 8, 9], [2], 1)])
    assert batch.token_ids.tolist() == [9, 9, 0, 0, 0, 0] and batch.positions.tolist() == [30, 31, 0, 1, 0, 1]
    assert batch.full_table.tolist() == [[7, 8, 9, 0], [0] * 4, [0] * 4] and batch.sliding_first.tolist() == [1, 0, 0]
    assert len(batch._mirrors.mirrors) == 2 and torch.equal(batch._mirrors.mirrors[0], first)


def test_a_verify_step_fills_each_static_shape_once(model, monkeypatch):
    """With 3 drafts a static verify step fills three shapes once each — the target's, the MTP
    catch-up's and the draft forwards' (its tables serve every draft; only positions and tokens
    move on the device): host work per step does not grow with the drafts."""
    from engine.decode_batch import DecodeBatch

    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20,
                                        block_size=16, speculative_tokens=3, adaptive_speculation=False,
                                        cpu_matmul_precision="fp32"))
    for i in range(2):
        engine.add_request(i, [3 + i, 40, 41, 9], SamplingParams(max_tokens=12, ignore_eos=True))
    fills, fill = [], DecodeBatch.fill
    monkeypatch.setattr(DecodeBatch, "fill", lambda self, rows: (fills.append(id(self)), fill(self, rows))[1])
    per_step = []
    while engine.has_work:
        before = len(fills)
        engine.step()
        per_step.append(fills[before:])
    verify = [f for f in per_step if len(f) == 3]
    assert len(verify) >= 3, per_step
    assert all(len(f) <= 3 for f in per_step), per_step


@pytest.mark.parametrize("kind", ["greedy", "sampled", "shaped"])
def test_the_drafting_chain_equals_the_draft_loop(model, kind):
    """A step's drafts through the static drafting chain (engine/draft_chain.py: every draft
    forward and the sampling between them in one program) equal the eager loop of draft
    forwards: the same tokens, the same acceptance at every depth, the same draft
    distributions."""
    params = {"greedy": SamplingParams(max_tokens=14, ignore_eos=True),
              "sampled": SamplingParams(max_tokens=14, temperature=6.0, seed=5, ignore_eos=True),
              "shaped": SamplingParams(max_tokens=14, temperature=6.0, top_k=40, top_p=0.9, seed=5,
                                       ignore_eos=True)}[kind]
    runs = {}
    for chained in (True, False):
        engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20,
                                            block_size=16, speculative_tokens=3, adaptive_speculation=False,
                                            cpu_matmul_precision="fp32"))
        if not chained:
            engine.runner._draft_chain = lambda *args: None
        draft_probs, draft = [], engine.runner._draft

        def recorded(*args, draft=draft, draft_probs=draft_probs, **kwargs):
            drafts, host = draft(*args, **kwargs)
            if drafts is not None and drafts.probs is not None:
                draft_probs.append(drafts.probs.clone())
            return drafts, host

        engine.runner._draft = recorded
        for i in range(3):
            engine.add_request(i, [3 + i, 40, 41, 9, 100 + i], params)
        out = {i: [] for i in range(3)}
        while engine.has_work:
            for d in engine.step().deltas:
                out[d.request_id] += d.token_ids
        runs[chained] = out, engine.stats.spec_accepted_per_position, draft_probs, engine.static._chains
    (chain_out, chain_acc, chain_probs, made), (loop_out, loop_acc, loop_probs, none) = runs[True], runs[False]
    assert chain_out == loop_out and chain_acc == loop_acc
    assert {key[2] for key in made} == {kind} and not none  # the chain ran (only) with the chained engine
    assert len(chain_probs) == len(loop_probs) and all(torch.equal(a, b) for a, b in zip(chain_probs, loop_probs))
    if kind != "greedy":
        assert chain_probs and sum(chain_acc) > 0
