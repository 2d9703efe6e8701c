"""The compiled CPU decode step (kernels/cpu_step.py) against what it replaces.

- Its torch-matching maths (kernels/cpu_step_math.py) against torch's own ops, bit for bit.
- Its slot tables (kernels/cpu_step_tables.py) against engine/v4/step_meta.py's StepMeta.
- Whole steps on tiny FP8/FP4 and dense-fp32 checkpoints against the op-by-op static forward
  (engine/v4/fused_decode.py with the compiled step off) on the same batch: with FP8/FP4 weights
  the final streams bit for bit up to 4 rows (every product stays on the row kernels the op path
  uses there; past kernels/cpu_gemv.DENSE_GEMV_MAX_ROWS its dense products, the router's among
  them, are torch's sgemm); within fp32 rounding past them, for dense weights (the op path's wo_a einsum and
  grouped_mm experts are torch's sgemm) and for the logits (the head's collapse dot); greedy
  tokens of whole runs identical.
- When it steps aside (the op path runs) and how it fails.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.decode_batch import DecodeBatch
from engine.engine import Engine
from engine.v4.fused_decode import FusedDecoder
from engine.v4.layers import RotaryTable, clamped_swiglu
from engine.v4.step_meta import StepMeta
from engine.weights import load_model
from ipc.messages import SamplingParams
from kernels import cpu_step_math as cm
from kernels.cpu_gemv import DENSE_GEMV_MAX_ROWS
from kernels import cpu_step_tables as ct
from kernels.reference import router_scores

GEOMETRY = dict(index_topk=2)                         # the indexer picks among more entries than k


def _bits(t) -> torch.Tensor:
    return torch.as_tensor(t).contiguous().view(torch.int32)


# ---- torch's elementwise maths --------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,width", [(1, 8), (3, 96), (7, 128), (13, 40), (200, 512)])
def test_swiglu_is_torchs_bit_for_bit(rows, width, threads):
    """Tails, vector bodies and (200 × 512 > GRAIN) the per-thread pieces of torch's loop."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(rows)
        h = torch.randn(rows, 2 * width, generator=g) * 6
        h[0, :4] = torch.tensor([float("nan"), 50.0, -120.0, 0.0])
        want = clamped_swiglu(h[:, :width], h[:, width:], 7.0)
        got = np.empty((rows, width), np.float32)
        cm.swiglu_rows(h.numpy(), 7.0, got, cm.CHUNK, threads)
    finally:
        torch.set_num_threads(saved)
    assert cm.EXACT
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("tokens,experts", [(1, 8), (1, 64), (5, 64), (16, 128)])
def test_router_scores_are_torchs_bit_for_bit(tokens, experts):
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(tokens, experts, generator=g) * 8
    logits[0, :3] = torch.tensor([25.0, -95.0, -0.0])                  # past the threshold, subnormal, -0
    got = np.empty((tokens, experts), np.float32)
    cm.router_scores(logits.numpy(), got, cm.SOFTPLUS_CHUNK, torch.get_num_threads())
    want = router_scores(logits)
    if cm.SOFTPLUS_EXACT and cm.VML_SQRT:
        assert torch.equal(_bits(got), _bits(want))
    else:                                                              # documented: within an fp32 ulp
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=2.4e-7, atol=0)


def test_sleef_log1pf_edges():
    for d, want in [(0.0, 0.0), (-0.0, -0.0), (-1.0, -np.inf), (3e38, np.inf), (3.0, np.log1p(3.0))]:
        got = cm.sleef_log1pf(np.float32(d))
        assert np.isclose(got, want, rtol=1e-7) or got == want
    assert np.isnan(cm.sleef_log1pf(np.float32(-2.0))) and np.signbit(cm.sleef_log1pf(np.float32(-0.0)))
    assert cm.sleef_expf(np.float32(-200)) == 0 and cm.sleef_expf(np.float32(200)) == np.inf


# ---- slot tables ---------------------------------------------------------------------------------

@pytest.mark.parametrize("q", [1, 3])
def test_slot_tables_equal_step_meta(q):
    block, window, b = 16, 8, 3
    cfg = SimpleNamespace(sliding_window=window)
    cache = SimpleNamespace(layout=SimpleNamespace(block_size=block), device="cpu")
    batch = DecodeBatch.allocate(cache, b, q, full_blocks=4, sliding_blocks=3)
    rng = random.Random(q)
    rows = []
    for i in range(b - 1):                                              # the last row stays padding
        start = rng.randint(0, 4 * block - q)
        first = max(0, start - window) // block
        rows.append(([rng.randint(0, 99) for _ in range(q)], start, rng.sample(range(1, 40), 4),
                     rng.sample(range(1, 40), 3), first))
    batch.fill(rows)
    rope = RotaryTable(8, 160000.0, None)
    meta = StepMeta.build(batch, cfg, rope, {4: {8}, 8: {8}})
    n = b * q
    args = (batch.start.numpy(), batch.sliding_table.numpy(), batch.sliding_first.numpy(), block)
    writes, slots = np.empty(n, np.int64), np.empty((n, window - 1), np.int32)
    ct.window_tables(batch.positions.numpy(), *args[:3], block, window, writes, slots)
    assert np.array_equal(writes, meta.window_writes.numpy())
    assert np.array_equal(slots, meta.window_slots.reshape(n, -1).numpy())
    span_rows = np.empty((b, 8 - 1 + q), np.int64)
    ct.span_rows(*args, 8, q, span_rows)
    assert np.array_equal(span_rows, meta.rows[8].numpy())
    cos_table, sin_table = rope(torch.arange(batch.max_context))
    for m in (4, 8):
        completes, counts = np.empty((b, q), np.int64), np.empty(b, np.int64)
        entry_pos, visible = np.empty((b, q), np.int64), np.empty((n, batch.max_context // m), np.int32)
        ct.ratio_tables(batch.positions.numpy(), batch.start.numpy(), batch.full_table.numpy(), block, m, completes,
                        counts, entry_pos, visible)
        assert np.array_equal(completes, meta.completes[m].numpy()) and np.array_equal(counts, meta.counts[m].numpy())
        assert np.array_equal(visible, meta.visible[m].reshape(n, -1).numpy())
        cos, sin = np.empty((n, 4), np.float32), np.empty((n, 4), np.float32)
        ct.rope_rows(cos_table.numpy(), sin_table.numpy(), entry_pos.ravel(), cos, sin)
        assert torch.equal(torch.from_numpy(cos), meta.entry_rope[m][0].reshape(n, -1))
        assert torch.equal(torch.from_numpy(sin), meta.entry_rope[m][1].reshape(n, -1))


def test_rope_table_rows_equal_the_rotary_tables_values():
    """The step reads RoPE from tables of every position: an element must not depend on which
    positions it was computed with."""
    positions = torch.tensor([0, 7, 1000, 4095, 12, 12])
    for table in (RotaryTable(64, 10000.0, None), RotaryTable(64, 160000.0, None)):
        cos, sin = table(torch.arange(4096))
        want_cos, want_sin = table(positions)
        assert torch.equal(cos[positions], want_cos) and torch.equal(sin[positions], want_sin)


# ---- whole steps -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(checkpoint_factory):
    dense = checkpoint_factory("tiny-topk2", **GEOMETRY)
    quant = checkpoint_factory("tiny-fp8-fp4", dtype=torch.bfloat16, quantize="fp8-fp4", index_topk=64)
    return {"dense": load_model(dense, dtype=torch.float32, progress=False),
            "fp8-fp4": load_model(quant, dtype=torch.float32, progress=False)}


def _engine(model, seqs: int, **kw) -> Engine:
    # one step per call: these tests compare each step with the op path's (tests/kernels/
    # test_cpu_greedy_steps.py runs several greedy steps per call)
    args = dict(max_num_seqs=seqs, max_num_batched_tokens=512, kv_cache_memory_bytes=8 << 20, block_size=16,
                cuda_graph_sizes=(1, 2, 4, 8, 16), static_decode=True, max_model_len=256, cpu_decode_steps=1)
    args.update(kw)
    return Engine(model, EngineConfig(**args))


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab - 1, (10 + 9 * i,), generator=g).tolist() for i in range(n)]


def _run(engine: Engine, prompts, steps: int = 6) -> dict[int, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_tokens=steps, ignore_eos=True))
    out: dict[int, list[int]] = {}
    while engine.has_work:
        for d in engine.step().deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return out


class _Compare:
    """Runs every static step both ways on the same batch: the op path first (its KV writes are
    the ones the compiled step makes again), then the compiled step, whose outputs go on."""

    def __init__(self, monkeypatch):
        self.results = []
        forward_logits = FusedDecoder.forward_logits   # the static backend's target step

        def both(decoder, batch):
            decoder.cpu_step = False
            ref = decoder.forward(batch).clone()
            ref_logits = decoder.model.logits(ref)
            decoder.cpu_step = True
            assert decoder.program(batch) is not None
            streams, logits = forward_logits(decoder, batch)
            self.results.append((batch.token_ids.shape[0], ref, streams.clone(), ref_logits, logits.clone()))
            return streams, logits

        monkeypatch.setattr(FusedDecoder, "forward_logits", both)


@pytest.mark.parametrize("kind", ["dense", "fp8-fp4"])
@pytest.mark.parametrize("seqs", [2, 4, 11])
def test_a_step_equals_the_op_path(models, monkeypatch, kind, seqs):
    model = models[kind]
    compare = _Compare(monkeypatch)
    _run(_engine(model, seqs), _prompts(seqs, model.cfg.vocab_size, seqs), steps=4)
    assert len(compare.results) >= 2
    for rows, ref, streams, ref_logits, logits in compare.results:
        if kind == "fp8-fp4" and rows <= DENSE_GEMV_MAX_ROWS:
            assert torch.equal(streams.view(torch.int32), ref.view(torch.int32))
        else:                                   # the op path's torch products: sgemm sums
            torch.testing.assert_close(streams, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["dense", "fp8-fp4"])
def test_greedy_tokens_equal_the_op_path(models, kind):
    model = models[kind]
    prompts = _prompts(4, model.cfg.vocab_size, seed=7)
    compiled = _run(_engine(model, 4), prompts, steps=10)
    saved = FusedDecoder.cpu_step
    FusedDecoder.cpu_step = False
    try:
        ops = _run(_engine(model, 4), prompts, steps=10)
    finally:
        FusedDecoder.cpu_step = saved
    assert compiled == ops and all(len(v) == 10 for v in compiled.values())


# ---- when it steps aside, and failures ----------------------------------------------------------

def _decoder_and_batch(model, **kw):
    engine = _engine(model, 2, **kw)
    _run(engine, _prompts(2, model.cfg.vocab_size), steps=2)
    shape = next(iter(engine.static._shapes.values()))
    return engine.static.fused, shape.batch


def test_quantized_kv_pools_and_hooks_take_the_op_path(models, checkpoint_factory):
    quantizable = dict(head_dim=128, qk_rope_head_dim=64, index_head_dim=64, index_topk=3)  # as test_decode_graphs
    model = load_model(checkpoint_factory("tiny-q", **quantizable), dtype=torch.float32, progress=False)
    decoder, batch = _decoder_and_batch(model, kv_dtype="fp8")
    assert decoder.program(batch) is None
    decoder, batch = _decoder_and_batch(models["dense"])
    assert decoder.program(batch) is not None
    decoder.on_layer = lambda index: None
    try:
        assert decoder.program(batch) is None
    finally:
        decoder.on_layer = None


def test_a_replaced_weight_rebuilds_the_program(models):
    decoder, batch = _decoder_and_batch(models["dense"])
    first = decoder.program(batch)
    assert first is not None and decoder.program(batch) is first
    wq = decoder.model.layers[0].attn.wo_b
    saved = wq.weight
    wq.weight = torch.nn.Parameter(saved.detach().clone(), requires_grad=False)
    try:
        second = decoder.program(batch)
        assert second is not first and second is not None and second.valid()
    finally:
        wq.weight = saved


def test_a_token_id_past_the_vocabulary_is_an_index_error(models):
    decoder, batch = _decoder_and_batch(models["dense"])
    program = decoder.program(batch)
    with torch.inference_mode():                          # the batch's buffers are inference tensors
        saved = batch.token_ids.clone()
        batch.token_ids[0] = models["dense"].cfg.vocab_size
        try:
            with pytest.raises(IndexError, match="token ids"):
                program.run()
        finally:
            batch.token_ids.copy_(saved)
