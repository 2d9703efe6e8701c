"""Chunked prefill, token-by-token decode, batching and rewind all equal one full forward."""

from __future__ import annotations

import pytest
import torch

from engine.v4.attention import SeqSlice, SequenceContext
from engine.weights import load_model

# Chunk schedules crossing the window (8) and the compress boundaries (4 and 8) of `tiny`.
SCHEDULES = [[41], [13, 15, 13], [1] * 41, [7, 1, 9, 24], [3, 5, 8, 9, 16], [4, 4, 8, 8, 17], [40, 1]]


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    # index_topk 2 < entries: the indexer's top-k path is exercised too.
    return load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.float32, progress=False)


def _run(model, ids: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    state, outs, pos = model.new_state(), [], 0
    for n in schedule:
        streams = model(ids[pos : pos + n], torch.arange(pos, pos + n), SequenceContext([SeqSlice(state, pos, 0, n)]))
        outs.append(model.logits(streams))
        pos += n
    assert pos == len(ids)  # the schedule covered every token
    return torch.cat(outs)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: "-".join(map(str, s[:6])))
@torch.no_grad()
def test_chunked_prefill_equals_full_forward(model, schedule):
    ids = torch.randint(2, model.cfg.vocab_size, (41,), generator=torch.Generator().manual_seed(5))
    full = _run(model, ids, [41])
    assert (_run(model, ids, schedule) - full).abs().max().item() <= 1e-5


@torch.no_grad()
def test_unpadded_batch_equals_each_sequence_alone(model):
    lengths = [41, 23, 1, 9]
    prompts = [torch.randint(2, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    alone = [_run(model, p, [len(p)]) for p in prompts]
    # Step 1: the first 5 tokens of every prompt (or all of it); step 2: the rest, mixed sizes.
    states = [model.new_state() for _ in prompts]
    done = [0] * len(prompts)  # positions each state holds
    outs = [[] for _ in prompts]
    for step in range(2):
        tokens, positions, seqs, begin = [], [], [], 0
        for i, p in enumerate(prompts):
            lo = done[i]
            hi = min(len(p), 5) if step == 0 else len(p)
            if hi == lo:
                continue
            tokens.append(p[lo:hi])
            positions.append(torch.arange(lo, hi))
            seqs.append(SeqSlice(states[i], lo, begin, hi - lo))
            begin += hi - lo
        logits = model.logits(model(torch.cat(tokens), torch.cat(positions), SequenceContext(seqs)))
        for s in seqs:
            i = states.index(s.state)
            outs[i].append(logits[s.begin : s.end])
            done[i] = s.start + s.length
    for i in range(len(prompts)):
        assert (torch.cat(outs[i]) - alone[i]).abs().max().item() <= 1e-5


@torch.no_grad()
def test_rewind_discards_speculative_tokens(model):
    """Writing 3 wrong tokens, rewinding and continuing equals never having written them,
    across window and compress boundaries (the rollback rule of speculative decoding)."""
    ids = torch.randint(2, model.cfg.vocab_size, (33,), generator=torch.Generator().manual_seed(9))
    wrong = torch.randint(2, model.cfg.vocab_size, (3,), generator=torch.Generator().manual_seed(10))
    full = _run(model, ids, [33])
    state, pos, outs = model.new_state(), 0, []
    for n in [6, 5, 9, 4, 9]:
        model(torch.cat((ids[pos : pos + n - 1], wrong)), torch.arange(pos, pos + n + 2), SequenceContext([SeqSlice(state, pos, 0, n + 2)]))
        # Keep n−1 tokens, then re-run from there with the true continuation.
        streams = model(ids[pos + n - 1 : pos + n], torch.arange(pos + n - 1, pos + n), SequenceContext([SeqSlice(state, pos + n - 1, 0, 1)]))
        outs.append(model.logits(streams))
        pos += n
    want = full[[p - 1 for p in (6, 11, 20, 24, 33)]]
    assert (torch.cat(outs) - want).abs().max().item() <= 1e-5


@torch.no_grad()
def test_a_zero_token_step_runs_every_layer(model):
    """What an idle rank runs under expert parallelism (a dummy batch): the model and the MTP
    layer over zero tokens, through every layer, touching no state."""
    from engine.attention_backend import SequenceStep

    before = model.layers_run
    step = SequenceStep([], model.device)
    streams, logits = step.run(model, [])
    assert streams.shape == (0, model.cfg.hc_mult, model.cfg.hidden_size) and logits is None
    assert model.layers_run == before + model.cfg.num_layers
    if len(model.mtp):
        out, _ = step.run(model, [], inputs=streams)
        assert out.shape == streams.shape
