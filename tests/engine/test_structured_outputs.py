"""Grammar-constrained decoding in the engine (engine/structured/), on a random-weight tiny V4
(the ≥ 20 schemas, greedy and sampled, through the openai client: tests/e2e/test_structured_api.py).

Independent checks: every JSON output parses with `json.loads` and validates with the
`jsonschema` package; regex outputs `re.fullmatch`; choices are one of the choices; EBNF
outputs are re-checked by a fresh xgrammar matcher. Also: greedy output with MTP equals greedy
output without (drafts the grammar forbids are rejected, never emitted), a request waits for
its grammar's compile while others run, a grammar that does not compile finishes its request
with a 400 error, the bitmask applied on the device masks exactly what xgrammar's own kernel
masks, and speculation's rows follow the drafts.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.structured import RequestGrammar, apply_bitmask  # noqa: E402
from engine.structured.bitmask import apply_bitmask_ops  # noqa: E402
from engine.structured import compiler as grammar_compiler  # noqa: E402
from engine.weights import load_model  # noqa: E402
from ipc.messages import SamplingParams, StructuredOutput  # noqa: E402
from tests.structured_schemas import SCHEMAS  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    from tokenization.synthetic_bpe import write_tokenizer

    path = checkpoint_factory("tiny-structured", index_topk=64)
    if not (path / "tokenizer.json").exists():
        write_tokenizer(path, 512)
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _engine(model, **overrides) -> Engine:
    config = dict(max_num_seqs=16, max_num_batched_tokens=512, kv_cache_memory_bytes=64 << 20, block_size=16)
    return Engine(model, EngineConfig(**{**config, **overrides}))


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> tuple[dict, dict]:
    """Drive the engine to the end: (request id → tokens, request id → Finished)."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(i, prompt, params)
    tokens, finished = {i: [] for i in range(len(requests))}, {}
    deadline = time.monotonic() + 600
    while engine.has_work:
        assert time.monotonic() < deadline
        out = engine.step()
        if not (out.deltas or out.finished) and engine.waits_on_grammars_only:
            time.sleep(0.005)  # what the worker does: sleep until a compile ends
        for d in out.deltas:
            tokens[d.request_id] += d.token_ids
        for f in out.finished:
            finished[f.request_id] = f
    return tokens, finished


def _json_requests(tokenizer, temperature: float, names: list[str], max_tokens: int = 400
                   ) -> list[tuple[list[int], SamplingParams]]:
    prompt = tokenizer.encode("Reply in JSON:").ids
    return [(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                                    structured=StructuredOutput("json", json.dumps(SCHEMAS[name]))))
            for i, name in enumerate(names)]


def test_mtp_and_async_scheduling_keep_greedy_output(model, tokenizer):
    """Greedy output with MTP k = 3 and async scheduling equals plain greedy output, schema by
    schema (the grammar masks every verified row; a forbidden draft is rejected), and it
    validates."""
    names = ["nested", "array_bounds", "any_of", "ref_defs", "pattern", "one_of", "recursive", "mixed"]
    plain, _ = _run(_engine(model), _json_requests(tokenizer, 0.0, names))
    spec, finished = _run(_engine(model, speculative_tokens=3, adaptive_speculation=False, async_scheduling=True),
                          _json_requests(tokenizer, 0.0, names))
    assert spec == plain
    assert all(f.reason == "stop" for f in finished.values())
    for i, name in enumerate(names):
        jsonschema.validate(json.loads(tokenizer.decode(spec[i])), SCHEMAS[name])


def test_regex_choice_and_grammar(model, tokenizer):
    prompt = tokenizer.encode("Answer:").ids
    ebnf = 'root ::= "(" item (", " item)* ")"\nitem ::= [a-c] [0-9]'
    specs = [StructuredOutput("regex", r"[A-Z][a-z]{2,5} [0-9]{1,3}"),
             StructuredOutput("choice", json.dumps(["yes", "no", "maybe later"])), StructuredOutput("grammar", ebnf)]
    requests = [(prompt, SamplingParams(max_tokens=120, temperature=t, seed=s, structured=spec))
                for spec in specs for t, s in ((0.0, 0), (1.0, 7))]
    tokens, finished = _run(_engine(model), requests)
    texts = [tokenizer.decode(tokens[i]) for i in range(len(requests))]
    assert [finished[i].reason for i in range(len(requests))] == ["stop"] * len(requests), texts
    for text in texts[0:2]:
        assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{1,3}", text), text
    for text in texts[2:4]:
        assert text in ("yes", "no", "maybe later")
    for text in texts[4:6]:
        assert re.fullmatch(r"\(([a-c][0-9])(, [a-c][0-9])*\)", text), text


def test_json_object_on_the_trained_model():
    """Any JSON object: its keys are unbounded strings, which a random-weight model sampling among
    the letters it allows may never close, so the trained built-in model writes them."""
    from server.builtin import trained_model_dir
    from tokenizers import Tokenizer

    path = trained_model_dir()
    if path is None:
        pytest.skip("no trained built-in model in server/builtin_model/")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    model = load_model(path, dtype=torch.float32, progress=False)
    prompt = tokenizer.encode("Return a JSON object:").ids
    requests = [(prompt, SamplingParams(max_tokens=200, temperature=t, seed=3, structured=StructuredOutput(
        "json_object", any_whitespace=ws))) for ws in (True, False) for t in (0.0, 1.0)]
    tokens, finished = _run(_engine(model), requests)
    for i in range(len(requests)):
        text = tokenizer.decode(tokens[i])
        assert finished[i].reason == "stop" and isinstance(json.loads(text), dict), text


def test_n_choices_stop_strings_and_logprobs(model, tokenizer):
    """Each choice has its own matcher; logprobs stay the raw distribution's (as vLLM reports
    them); a seed reproduces a sampled constrained output."""
    prompt = tokenizer.encode("Pick:").ids
    spec = StructuredOutput("json", json.dumps(SCHEMAS["enum"]))
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, logprobs=2, structured=spec) for s in (1, 2, 1)]
    tokens, finished = _run(_engine(model), [(prompt, p) for p in params])
    assert tokens[0] == tokens[2]  # the same seed, the same output
    for i in range(3):
        jsonschema.validate(json.loads(tokenizer.decode(tokens[i])), SCHEMAS["enum"])


def test_a_request_waits_for_its_grammar_while_others_run(model, tokenizer, monkeypatch):
    """A slow compile holds back only its own request: an unconstrained request runs to the
    end meanwhile; the constrained one starts when its grammar is ready."""
    release = threading.Event()
    real = grammar_compiler.compile_spec

    def slow(compiler, spec):
        release.wait(30)
        return real(compiler, spec)

    monkeypatch.setattr(grammar_compiler, "compile_spec", slow)
    engine = _engine(model)
    prompt = tokenizer.encode("Hi").ids
    engine.add_request(0, prompt, SamplingParams(max_tokens=20, structured=StructuredOutput("regex", "[0-9]{4}")))
    engine.add_request(1, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    done = {}
    while 1 not in done:
        out = engine.step()
        done.update({f.request_id: f for f in out.finished})
    assert 0 not in done and engine.waits_on_grammars_only  # request 0 still waits, request 1 is done
    release.set()
    tokens, finished = {0: []}, {}
    while engine.has_work:
        out = engine.step()
        if not (out.deltas or out.finished) and engine.waits_on_grammars_only:
            time.sleep(0.005)
        tokens[0] += [t for d in out.deltas for t in d.token_ids]
        finished.update({f.request_id: f for f in out.finished})
    assert finished[0].reason == "stop" and re.fullmatch("[0-9]{4}", tokenizer.decode(tokens[0]))


def test_a_grammar_that_does_not_compile_is_a_400(model, tokenizer):
    engine = _engine(model)
    prompt = tokenizer.encode("Hi").ids
    tokens, finished = _run(engine, [(prompt, SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "(ab"))),
                                     (prompt, SamplingParams(max_tokens=4, ignore_eos=True))])
    assert finished[0].reason == "error" and finished[0].error_code == 400 and "regex" in finished[0].error
    assert tokens[0] == [] and len(tokens[1]) == 4
    assert engine.cache.manager.full.num_free == engine.cache.manager.full.num_blocks - 1  # nothing held


@pytest.mark.parametrize("apply", [apply_bitmask_ops, apply_bitmask], ids=["device-ops", "dispatch"])
def test_device_bitmask_masks_what_xgrammars_kernel_masks(apply):
    """apply_bitmask's torch ops (the GPU's path) and its CPU dispatch (xgrammar's kernel, rows
    placed) against xgrammar's own CPU kernel on the full bitmask."""
    rng = np.random.default_rng(0)
    vocab = 1000
    words = torch.from_numpy(rng.integers(-(2**31), 2**31 - 1, size=(9, (vocab + 31) // 32),
                                          dtype=np.int64).astype(np.int32))  # [N, W]
    logits = torch.randn(9, vocab)
    rows = torch.tensor([0, 2, 3, 5, 7, 8])
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, words, indices=rows.tolist())  # row i masked by words[i]
    assert torch.equal(apply(logits, words[rows], rows), theirs)
    everything = logits.clone()
    xgr.apply_token_bitmask_inplace(everything, words)
    assert torch.equal(apply(logits, words), everything)


def test_speculative_rows_follow_the_drafts(tokenizer, model_dir):
    """RequestGrammar.fill: row j is the state after j drafts; rows after a draft the grammar
    forbids repeat the last state; the matcher is left where it was. start_after: rows before
    the start token are unconstrained."""
    from engine.structured.vocab import tokenizer_info

    info = tokenizer_info(model_dir, 512, [1])
    compiled = xgr.GrammarCompiler(info).compile_regex("ab[0-9]+")
    ids = {c: tokenizer.token_to_id(c) for c in "abx7"}
    bitmask = xgr.allocate_token_bitmask(8, 512).numpy()

    def allowed(row: int, token: int) -> bool:
        return bool((bitmask[row, token // 32] >> (token % 32)) & 1)

    grammar = RequestGrammar(_done(compiled), None)
    grammar.start([])
    assert grammar.fill(bitmask, 0, [ids["a"], ids["x"], ids["b"]], 4) == [0, 1, 2, 3]
    assert allowed(0, ids["a"]) and allowed(1, ids["b"]) and not allowed(1, ids["x"])
    assert (bitmask[2] == bitmask[1]).all() and (bitmask[3] == bitmask[1]).all()  # past the forbidden draft
    assert grammar.advance([ids["a"], ids["b"], ids["7"]]) is None  # the fill rolled back: a, b, 7 are taken
    marker = tokenizer.token_to_id("x")
    late = RequestGrammar(_done(compiled), start_after=marker)
    late.start([])
    assert late.fill(bitmask, 4, [ids["7"], marker, ids["a"]], 4) == [2, 3]  # constrained after the marker
    assert allowed(6, ids["a"]) and allowed(7, ids["b"])
    assert late.advance([ids["7"], marker, ids["a"], ids["x"]]) == 3  # 'x' breaks it once it applies


def _done(value):
    from concurrent.futures import Future

    future = Future()
    future.set_result(value)
    return future


def test_v41_with_dspark_keeps_the_grammar(tmp_path_factory):
    """DeepSeek-V4.1 (a random four-layer release-format checkpoint): schemas validate with
    DSpark drafting and verifying (drafts the grammar forbids are rejected)."""
    from tokenizers import Tokenizer

    from engine.v41.checkpoint import write_v41_checkpoint

    layers = dict(num_hidden_layers=4, compress_ratios=[0, 2, 1, 1, 0], kv_source_layer_ids=[1, 2],
                  index_source_layer_ids=[1, 2, 3], candidate_source_layer_id=2, engram_layer_ids=[0, 1],
                  dspark_target_layer_ids=[1, 2, 3], num_nextn_predict_layers=1)
    path = write_v41_checkpoint(tmp_path_factory.mktemp("v41-structured") / "tiny", "tiny", seed=5, **layers)
    model = load_model(path, progress=False)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    names = ["enum", "pattern"]
    engine = _engine(model, max_num_seqs=4, speculative_tokens=model.cfg.v41.dspark_block_size,
                     adaptive_speculation=False)
    tokens, finished = _run(engine, _json_requests(tokenizer, 0.0, names))
    assert all(f.reason == "stop" for f in finished.values())
    assert engine.stats.spec_drafts > 0
    for i, name in enumerate(names):
        jsonschema.validate(json.loads(tokenizer.decode(tokens[i])), SCHEMAS[name])


def test_preemption_and_prefix_cache_hits_keep_the_grammar(model, tokenizer):
    """A pool too small for the batch preempts grammar requests mid-answer; each resumes by
    recomputing its prompt and output, and its matcher (which never saw the preemption) goes on
    from the same state: greedy output equals the roomy engine's, and validates. The same
    requests again then start on cached prefix blocks, with the same output."""
    names = ["nested", "array_bounds", "any_of", "pattern"]
    requests = _json_requests(tokenizer, 0.0, names, max_tokens=100)
    roomy, _ = _run(_engine(model, enable_prefix_caching=False), requests)
    need = [-(-(len(requests[i][0]) + len(t)) // 16) for i, t in roomy.items()]  # blocks each answer ends on
    cramped = _engine(model, num_kv_blocks=max(9, sum(need) // 2), enable_prefix_caching=False)
    got, finished = _run(cramped, requests)
    assert cramped.stats.num_preemptions > 0
    assert got == roomy and all(f.reason == "stop" for f in finished.values())
    for i, name in enumerate(names):
        jsonschema.validate(json.loads(tokenizer.decode(got[i])), SCHEMAS[name])

    cached = _engine(model)
    long = [(prompt * 3, params) for prompt, params in requests]  # whole blocks to hit
    first, _ = _run(cached, long)
    again, finished = _run(cached, long)
    assert first == again
    assert all(f.cached_tokens > 0 for f in finished.values()), [f.cached_tokens for f in finished.values()]
