"""The reference against itself: decode, chunked prefill and full prefill of the same tokens.

Under row-independent numerics (RefOptions(row_independent=True)) a token's result may not
depend on the chunk it is computed in, so one-token decode, a prefill split at awkward places
(a one-token chunk, a ratio-2 group cut in half, candidate blocks cut mid-block) and a single
full prefill must give bit-identical logits, bit-identical sequence state (window rows,
compressor tail, compressed KV, index keys, Engram history, DSpark windows) and identical
DSpark drafts. The golden checkpoints provide realistic weights.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.v41.ref_attention import RefOptions
from tests.v41.ref_dspark import DSpark
from tests.v41.ref_state import SequenceState
from tests.v41.reference_model import ReferenceV41
from tests.v41.release_checkpoint import load_release_checkpoint


@pytest.fixture(scope="module", params=["c1", "c2"])
def case(request, golden_root):
    d = golden_root / request.param
    golden = json.loads((d / "golden.json").read_text())
    model = ReferenceV41(load_release_checkpoint(d), options=RefOptions(row_independent=True))
    return model, golden


def run_chunks(model: ReferenceV41, tokens: list[int], cuts: list[int]) -> tuple[torch.Tensor, SequenceState]:
    """Logits [T, V] of `tokens` fed as the chunks between `cuts`, with DSpark observing each."""
    state, dspark, logits = model.new_state(), DSpark(model), []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        out = model.forward(state, tokens[lo:hi])
        dspark.observe(state, out.main_hidden, lo)
        logits.append(out.logits)
    return torch.cat(logits), state


def assert_same_state(a: SequenceState, b: SequenceState) -> None:
    assert a.length == b.length and a.engram_ids == b.engram_ids
    for key in ("window_kv", "dspark_kv"):
        da, db = getattr(a, key), getattr(b, key)
        assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da), key
    assert a.sources.keys() == b.sources.keys()
    for layer, sa in a.sources.items():
        sb = b.sources[layer]
        for field in ("pending_kv", "pending_score", "compressed_kv", "index_keys"):
            assert torch.equal(getattr(sa, field), getattr(sb, field)), (layer, field)


@pytest.mark.parametrize("prompt", [0, 1])
def test_decode_and_chunked_prefill_equal_full_prefill(case, prompt):
    model, golden = case
    p = golden["prompts"][prompt]
    tokens = p + golden["tokens"][prompt][:9]
    full, full_state = run_chunks(model, tokens, [0, len(tokens)])
    decode, decode_state = run_chunks(model, tokens, [0, len(p)] + list(range(len(p) + 1, len(tokens) + 1)))
    chunked, chunked_state = run_chunks(model, tokens, [0, 7, 8, len(p) // 2 + 1, len(p) + 3, len(tokens)])
    assert torch.equal(decode, full) and torch.equal(chunked, full)
    assert_same_state(decode_state, full_state)
    assert_same_state(chunked_state, full_state)
    drafts = [DSpark(model).draft(s, golden["tokens"][prompt][9], len(tokens) - 1) for s in (full_state, chunked_state)]
    assert drafts[0].tokens == drafts[1].tokens and torch.equal(drafts[0].confidence, drafts[1].confidence)


def test_state_is_bounded(case):
    """What a sequence keeps: window rows ≤ window, a ratio-2 tail < 2 rows, one compressed
    entry and one index key per completed group."""
    model, golden = case
    cfg = model.cfg
    tokens = golden["prompts"][1][:45]
    _, state = run_chunks(model, tokens, [0, 45])
    assert all(rows.shape[0] == cfg.window for rows in state.window_kv.values())
    for layer, src in state.sources.items():
        ratio = cfg.compress_ratios[layer]
        assert src.pending_kv.shape[0] == 45 % ratio
        assert src.compressed_kv.shape[0] == src.index_keys.shape[0] == 45 // ratio
