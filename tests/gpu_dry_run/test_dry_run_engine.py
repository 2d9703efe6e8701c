"""Engine steps on the fake CUDA device: prefill, captured decode and verify steps, greedy /
top-p / seeded sampling, MTP with k = 0, 2, 3 drafts, with and without async scheduling, a
request arriving mid-run (a mixed prefill + decode step) and a pool small enough to preempt.

What a GPU needs of every step: at most one device-to-host copy (the step's results, read once,
engine/step_sampling.py `start_read`), no host wait while launching under async scheduling,
nothing data-dependent inside a captured graph (a fault raises), and decode steps replayed from
graphs. Values are placeholders (host copies read as `fill`), so tokens are not checked here;
the CPU tests check them.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.weights import load_model
from ipc.messages import SamplingParams

from .test_dry_run_static import GEOMETRY

PARAMS = [SamplingParams(max_tokens=12, ignore_eos=True),
          SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9),
          SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_k=20, seed=5)]
LATE = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, seed=9)


@pytest.mark.parametrize("k,async_scheduling", [(0, False), (0, True), (2, False), (2, True), (3, False), (3, True)],
                         ids=lambda v: str(v))
@torch.inference_mode()
def test_engine_steps_make_one_host_read(fake_device, checkpoint_factory, k, async_scheduling):
    model = load_model(checkpoint_factory("dry-dense", **GEOMETRY), dtype=torch.bfloat16, device="cuda",
                       progress=False)
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16, num_kv_blocks=5,
                                        cuda_graph_sizes=(2, 4), static_decode=True, speculative_tokens=k,
                                        adaptive_speculation=False, max_model_len=64, enable_prefix_caching=False,
                                        async_scheduling=async_scheduling))
    assert engine.async_scheduling == async_scheduling
    assert fake_device.captures > 0  # start-up captured every shape (and drafting chain)
    launches = []  # per runner launch: (device-to-host copies, host syncs, launched ahead)
    launch = engine.runner.launch

    def counted(batch, *args, ahead=None, **kwargs):
        mark = fake_device.mark()
        out = launch(batch, *args, ahead=ahead, **kwargs)
        launches.append((len(fake_device.since(mark, "d2h")), len(fake_device.syncs(mark)), ahead is not None))
        return out

    engine.runner.launch = counted
    for i, params in enumerate(PARAMS):
        engine.add_request(i, [5 + i] + list(range(10, 35)), params)
    steps, emitted = [], {i: 0 for i in range(len(PARAMS) + 1)}
    while engine.has_work:
        if len(steps) == 3:  # joins running decodes: a mixed prefill + decode step
            engine.add_request(len(PARAMS), list(range(40, 52)), LATE)
        mark, replays = fake_device.mark(), fake_device.replays
        out = engine.step()
        steps.append((len(fake_device.syncs(mark)), fake_device.replays - replays))
        for d in out.deltas:
            emitted[d.request_id] += len(d.token_ids)
    assert all(copies == 1 for copies, _, _ in launches), launches  # the step's results, in one copy
    assert all(syncs == 0 for _, syncs, ahead in launches if ahead), launches  # the host runs ahead
    assert all(syncs <= 1 for syncs, _ in steps), steps  # the one wait for a step's results
    assert sum(1 for _, replays in steps if replays) >= 3, steps  # decode steps replayed graphs
    if async_scheduling:
        assert sum(ahead for _, _, ahead in launches) >= 3, launches
    assert engine.scheduler.num_preemptions > 0
    assert emitted == {0: 12, 1: 12, 2: 12, 3: 6}


@pytest.mark.parametrize("k", [0, 3])
@torch.inference_mode()
def test_grammar_masks_add_no_host_read(fake_device, checkpoint_factory, monkeypatch, k):
    """Structured outputs on the fake device: the bitmask is filled on the host and copied over
    without blocking, applied to the logits on the device; a step with grammar requests still
    makes one results copy, and its decode steps still replay graphs. (The host reads back
    placeholder tokens here, which no grammar follows: the matcher takes them as given.)"""
    pytest.importorskip("xgrammar")
    from tokenization.synthetic_bpe import write_tokenizer

    from engine.structured import RequestGrammar
    from ipc.messages import StructuredOutput

    monkeypatch.setattr(RequestGrammar, "advance", lambda self, tokens: None)

    path = checkpoint_factory("dry-dense", **GEOMETRY)
    if not (path / "tokenizer.json").exists():
        write_tokenizer(path, 512)
    model = load_model(path, dtype=torch.bfloat16, device="cuda", progress=False)
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16, num_kv_blocks=16,
                                        cuda_graph_sizes=(2, 4), static_decode=True, speculative_tokens=k,
                                        adaptive_speculation=False, max_model_len=64, enable_prefix_caching=False))
    spec = StructuredOutput("regex", "[a-z]{3,9}")
    engine.add_request(0, list(range(10, 20)), SamplingParams(max_tokens=8, ignore_eos=True, structured=spec))
    engine.add_request(1, list(range(20, 30)), SamplingParams(max_tokens=8, temperature=0.9, seed=1, ignore_eos=True,
                                                             structured=spec))
    steps = []
    while engine.has_work:
        mark, replays = fake_device.mark(), fake_device.replays
        engine.step()
        steps.append((len(fake_device.since(mark, "d2h")), len(fake_device.syncs(mark)),
                      fake_device.replays - replays, len(fake_device.since(mark, "h2d"))))
    assert all(reads <= 1 and syncs <= 1 for reads, syncs, _, _ in steps), steps
    assert sum(1 for _, _, replays, _ in steps if replays) >= 2, steps
    assert engine.grammars is not None and engine.grammars.compiles == 1
