"""The compiled CPU decode step (kernels/cpu_step.py) inside a real engine, beyond plain decode:

- a bf16 checkpoint (every dense weight bf16-exact once loaded in fp32): the program reads the
  bf16 copies (kernels/cpu_gemv.py's bf16-bits row kernel) and each step's streams and logits
  equal the op path's (engine/v4/fused_decode.py with the compiled step off) within fp32 rounding;
  greedy tokens identical;
- MTP speculation: the verify steps (q = 1 + drafts tokens per sequence) run compiled, with
  streams bit for bit the op path's on FP8/FP4 weights up to 4 rows (past
  kernels/cpu_gemv.DENSE_GEMV_MAX_ROWS the op path's dense products, the router's among them, are
  torch's sgemm), within fp32 rounding past them; greedy tokens, and the accepted drafts, identical to the op path's engine.
The MTP layer's own draft steps (FusedDecoder.forward_mtp) stay on the op path.
"""
from __future__ import annotations

import numba
import pytest
import torch

from engine.engine import Engine
from engine.v4.fused_decode import FusedDecoder
from engine.weights import load_model
from ipc.messages import SamplingParams
from kernels import cpu_step_plan as plan
from kernels.cpu_gemv import DENSE_GEMV_MAX_ROWS
from kernels.cpu_step_linear import DENSE, DENSE_BF16
from tests.kernels.test_cpu_step import _engine, _prompts  # the same engine and prompts as the step tests


@pytest.fixture(scope="module")
def models(checkpoint_factory):
    bf16 = checkpoint_factory("tiny-bf16-topk2", dtype=torch.bfloat16, index_topk=2)
    quant = checkpoint_factory("tiny-fp8-fp4", dtype=torch.bfloat16, quantize="fp8-fp4", index_topk=64)
    return {"bf16": load_model(bf16, dtype=torch.float32, progress=False),
            "fp8-fp4": load_model(quant, dtype=torch.float32, progress=False)}


def _run(engine: Engine, prompts, steps: int) -> dict[int, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_tokens=steps, ignore_eos=True))
    out: dict[int, list[int]] = {}
    while engine.has_work:
        for d in engine.step().deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return out


def _op_path_run(model, prompts, steps: int, **kw) -> tuple[dict[int, list[int]], Engine]:
    saved = FusedDecoder.cpu_step
    FusedDecoder.cpu_step = False
    try:
        engine = _engine(model, len(prompts), **kw)
        return _run(engine, prompts, steps), engine
    finally:
        FusedDecoder.cpu_step = saved


class _Compare:
    """Runs every static target step both ways on the same batch: the op path first (its KV
    writes are the ones the compiled step makes again), then the compiled step, whose streams
    go on. Records (q, rows, op streams, compiled streams, op logits, compiled logits, program)."""

    def __init__(self, monkeypatch):
        self.results = []

        def both(decoder, batch):                 # in place of the static backend's target step
            decoder.cpu_step = False
            ref = decoder.forward(batch).clone()
            ref_logits = decoder.model.logits(ref)
            decoder.cpu_step = True
            program = decoder.program(batch)
            assert program is not None
            streams, logits = program.run()
            self.results.append((batch.tokens_per_seq, batch.token_ids.shape[0], ref, streams.clone(), ref_logits,
                                 logits.clone(), program))
            return streams, logits

        monkeypatch.setattr(FusedDecoder, "forward_logits", both)


@pytest.mark.parametrize("seqs", [2, 9])
def test_bf16_weights_step_equals_the_op_path(models, monkeypatch, seqs):
    model = models["bf16"]
    compare = _Compare(monkeypatch)
    _run(_engine(model, seqs), _prompts(seqs, model.cfg.vocab_size, seqs), steps=4)
    assert len(compare.results) >= 2
    for _, rows, ref, streams, ref_logits, logits, program in compare.results:
        kinds = program.lin_table[:, 0].tolist()
        assert DENSE_BF16 in kinds and DENSE not in kinds       # every dense product reads bf16 bits
        torch.testing.assert_close(streams, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_bf16_weights_greedy_tokens_equal_the_op_path(models):
    model = models["bf16"]
    prompts = _prompts(3, model.cfg.vocab_size, seed=3)
    compiled = _run(_engine(model, 3), prompts, steps=10)
    ops, _ = _op_path_run(model, prompts, steps=10)
    assert compiled == ops and all(len(v) == 10 for v in compiled.values())


_SPEC = dict(speculative_tokens=3, adaptive_speculation=False)


@pytest.mark.parametrize("seqs", [1, 4])
def test_verify_steps_with_mtp_drafts_equal_the_op_path(models, monkeypatch, seqs):
    """1 sequence × (1 + 3 drafts) = 4 rows: every product on the row kernels the op path uses,
    streams bit for bit; 4 × 4 = 16 rows: the op path hands some products to sgemm."""
    model = models["fp8-fp4"]
    compare = _Compare(monkeypatch)
    engine = _engine(model, seqs, **_SPEC)
    _run(engine, _prompts(seqs, model.cfg.vocab_size, seed=seqs), steps=6)
    verify = [r for r in compare.results if r[0] == 4]
    assert len(verify) >= 2, [r[:2] for r in compare.results]
    assert engine.stats.spec_drafts > 0 and engine.stats.spec_draft_tokens > 0
    for q, rows, ref, streams, ref_logits, logits, _ in verify:
        assert rows == seqs * q
        if rows <= DENSE_GEMV_MAX_ROWS:
            assert torch.equal(streams.view(torch.int32), ref.view(torch.int32))
        else:
            torch.testing.assert_close(streams, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_mtp_speculation_greedy_tokens_equal_the_op_path(models):
    model = models["fp8-fp4"]
    prompts = _prompts(3, model.cfg.vocab_size, seed=11)
    engine = _engine(model, 3, **_SPEC)
    compiled = _run(engine, prompts, steps=12)
    programs = [p for _, p in engine.static.fused._programs.values() if p is not None]
    assert any(p.rows > 3 for p in programs)                    # a verify shape ran compiled
    ops, op_engine = _op_path_run(model, prompts, steps=12, **_SPEC)
    assert compiled == ops and all(len(v) == 12 for v in compiled.values())
    assert engine.stats.spec_accepted_per_position == op_engine.stats.spec_accepted_per_position


def _run_at(model, prompts, steps: int, threads) -> tuple[dict, Engine]:
    """(request → [(token, logprob)], engine), numba at `threads(step)` threads for each step."""
    saved = numba.get_num_threads()
    engine = _engine(model, len(prompts))
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_tokens=steps, ignore_eos=True, logprobs=0))
    out: dict[int, list] = {}
    try:
        step = 0
        while engine.has_work:
            numba.set_num_threads(threads(step))
            for d in engine.step().deltas:
                out.setdefault(d.request_id, []).extend(zip(d.token_ids, d.logprobs))
            step += 1
    finally:
        numba.set_num_threads(saved)
    return out, engine


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one numba thread: the count cannot change")
def test_a_thread_count_change_gets_its_own_program_and_keeps_the_bits(models):
    """A CPU worker's thread count follows the host's load (engine/core_share.py). A program
    splits its products for the count it was built at (none at one thread), so each count gets
    its own program of the shape. The kernels split by output rows and heads, never inside a sum:
    with the count going 1, 2, 1, … tokens and logprobs equal a run at two threads exactly, and
    the tokens equal the op path's."""
    model = models["fp8-fp4"]
    prompts = _prompts(2, model.cfg.vocab_size, seed=5)
    alternating, engine = _run_at(model, prompts, 8, lambda step: 1 + step % 2)
    fixed, _ = _run_at(model, prompts, 8, lambda step: 2)
    assert alternating == fixed
    ops, _ = _op_path_run(model, prompts, steps=8)
    assert {i: [t for t, _ in v] for i, v in alternating.items()} == ops
    built = engine.static.fused._programs
    ones = [p for (_, threads), (_, p) in built.items() if threads == 1 and p is not None]
    twos = [p for (_, threads), (_, p) in built.items() if threads == 2 and p is not None]
    assert ones and twos and not {id(p) for p in ones} & {id(p) for p in twos}


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one numba thread: every product runs serially")
def test_which_products_split_over_threads():
    """A program's product runs its parallel kernel when its weight is large (memory-bound even at
    one row) or its weight bytes times its rows are (compute-bound); otherwise on the calling
    thread, where a parallel launch would cost more than it saves. At one thread, never."""
    per = plan.StepProgram._per                                   # uses no program state
    big, rows = plan.PARALLEL_WEIGHT_BYTES, 1024
    saved = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        assert per(None, rows, big, 1) > 0                        # batch 1, a large weight
        assert per(None, rows, big - 1, 1) == 0
        assert per(None, rows, plan.PARALLEL_BYTES // 16, 16) > 0  # a small weight met by 16 rows
        assert per(None, rows, plan.PARALLEL_BYTES // 16 - 1, 16) == 0
        numba.set_num_threads(1)
        assert per(None, rows, 64 * big, 16) == 0
    finally:
        numba.set_num_threads(saved)


def test_later_runs_skip_the_dispatcher(models, monkeypatch):
    """After its first run a program calls run_step's compiled entry point directly (numba's
    dispatcher would type every argument again); the result is the dispatcher's, bit for bit."""
    from kernels import cpu_step_plan

    engine = _engine(models["fp8-fp4"], 2)
    _run(engine, _prompts(2, models["fp8-fp4"].cfg.vocab_size), steps=3)
    program = next(p for _, p in engine.static.fused._programs.values() if p is not None)
    assert program.entry is not None
    with torch.inference_mode():
        streams, logits = (t.clone() for t in program.run())
        via_dispatcher = []
        monkeypatch.setattr(cpu_step_plan, "run_step", lambda *a: via_dispatcher.append(1))
        again = program.run()[0].clone()                          # the entry point, not the name
        assert not via_dispatcher
        assert torch.equal(again.view(torch.int32), streams.view(torch.int32))
        monkeypatch.undo()
        assert cpu_step_plan.run_step(*program._args, True, 0, 0, program._no_greedy) == 0      # the dispatcher on the same batch
        assert torch.equal(program.streams.view_as(streams), streams) and torch.equal(program.logits, logits)


def test_a_weight_written_in_place_remakes_its_bf16_copy(models):
    """The program reads a bf16 copy of the LM head, not its storage: an in-place write to the
    head (its version moves) must rebuild the program from the new values."""
    model = models["bf16"]
    engine = _engine(model, 2)
    _run(engine, _prompts(2, model.cfg.vocab_size), steps=2)
    decoder = engine.static.fused
    batch = next(s.batch for k, s in engine.static._shapes.items() if k[0] != "mtp")
    first = decoder.program(batch)
    assert first is not None and DENSE_BF16 in first.lin_table[:, 0].tolist()
    with torch.inference_mode():
        before = first.run()[1].clone()
        with torch.no_grad():
            model.head.mul_(2)                                  # still bf16-exact; every logit doubles exactly
        try:
            second = decoder.program(batch)
            assert second is not first and second.valid() and not first.valid()
            assert torch.equal(second.run()[1], 2 * before)
        finally:
            with torch.no_grad():
                model.head.mul_(0.5)
    assert decoder.program(batch) is not second
